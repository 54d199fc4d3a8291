"""Engine-level P/D stress: prefill and decode ``EngineCore`` pairs in one process, driven
through adversarial but seeded (so reproducible) interleavings, every request's greedy tokens
against one engine that ran the prompt alone on an empty cache.

What the interleavings vary, all from one ``random.Random(seed)``:
- bursts of shared-prefix requests (exact repeats and cuts of a few prefixes with new suffixes),
  so prefill engines hit blocks of requests still held for a reader, decode engines hit blocks
  other requests pulled, and the token budget of a step is often left with a remainder of a
  few tokens (a small ``max_num_batched_tokens``);
- which engines step when, and how many steps a handle waits before the decode engine gets it
  (reads land while the owner keeps computing, releasing and reusing blocks);
- some requests run whole on a decode engine (no transfer) beside the pulled ones;
- a small pool, so admissions fail, requests are preempted and recomputed, cached blocks are
  evicted and reused.

Used by ``tests/engine/test_pd_race.py`` (bounded) and ``benchmarks/pd_stress.py`` (longer).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from kvfleet_testing.presets import load_preset
from kvfleet_testing.workloads import shared_prefix_prompts

SAMPLING = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# a budget that leaves remainders: 64-token chunks plus a few decodes rarely fill it exactly
STRESS_OVERRIDES = ("scheduler.max_num_batched_tokens=65", "kv_cache.num_blocks=160")


def alone_tokens(
    config, prompts: list[list[int]], sampling: SamplingParams = SAMPLING
) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of every distinct prompt run alone on an empty prefix cache (one engine,
    the cache reset between prompts): an oracle no other request can have influenced."""
    from engine.core import EngineCore

    engine = EngineCore(config, threads=1)
    out: dict[tuple[int, ...], list[int]] = {}
    try:
        for prompt in prompts:
            key = tuple(prompt)
            if key in out:
                continue
            assert engine.coordinator.reset_prefix_cache()
            engine.add_request("oracle", prompt, sampling)
            tokens: list[int] = []
            while engine.has_work:
                for result in engine.step():
                    tokens += result.new_token_ids
            out[key] = tokens
    finally:
        engine.close()
    return out


@dataclass
class EngineStressResult:
    config: str
    requests: int = 0
    wrong_tokens: int = 0
    transferred: int = 0
    colocated: int = 0
    preemptions: int = 0
    read_failures: int = 0
    seconds: float = 0.0
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_engine_stress(
    preset: str,
    backend: str,
    num_prefill: int,
    num_decode: int,
    *,
    requests: int,
    seed: int = 0,
    overrides: tuple[str, ...] = STRESS_OVERRIDES,
    oracle: dict[tuple[int, ...], list[int]] | None = None,
    sampling: SamplingParams = SAMPLING,
) -> EngineStressResult:
    """Run ``requests`` shared-prefix requests through ``num_prefill`` prefill and ``num_decode``
    decode engines (``transfer.backend=backend``) in one seeded interleaving; compare every
    request's tokens with ``oracle`` (default: ``alone_tokens`` on the preset without
    ``overrides``). Engines are closed on return."""
    from engine.core import EngineCore

    config = load_preset(preset, [f"transfer.backend={backend}", *overrides])
    prompts = shared_prefix_prompts(seed, requests)
    if oracle is None:
        oracle = alone_tokens(load_preset(preset), prompts, sampling)
    rng = random.Random(seed * 7919 + 17)
    result = EngineStressResult(f"{preset}/{backend}/{num_prefill}P{num_decode}D")
    start = time.monotonic()
    prefill = [EngineCore(config, name=f"prefill-{i}", kv_role="prefill") for i in range(num_prefill)]
    decode = [EngineCore(config, name=f"decode-{i}", kv_role="decode") for i in range(num_decode)]
    engines = prefill + decode
    try:
        pending = list(enumerate(prompts))
        prefilling: dict[str, list[int]] = {}
        handles: list[tuple[int, str, list[int], Any]] = []  # (deliver at iteration, id, prompt, handle)
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()
        iteration = 0
        deadline = time.monotonic() + 600
        while pending or prefilling or handles or any(e.has_work for e in engines):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{result.config}: requests still running after 600 s")
            iteration += 1
            if pending and rng.random() < 0.4:  # a burst of 1-8 requests
                for _ in range(min(len(pending), rng.randrange(1, 9))):
                    index, prompt = pending.pop(0)
                    request_id = f"r{index}"
                    if rng.random() < 0.15:  # run whole on a decode engine, beside pulled requests
                        rng.choice(decode).add_request(request_id, prompt, sampling)
                        tokens[request_id] = []
                        result.colocated += 1
                    else:
                        rng.choice(prefill).add_request(request_id, prompt, sampling, prefill_only=True)
                        prefilling[request_id] = prompt
            for item in [h for h in handles if h[0] <= iteration]:
                handles.remove(item)
                _, request_id, prompt, handle = item
                rng.choice(decode).add_request(request_id, prompt, sampling, kv_handle=handle)
                tokens[request_id] = []
                result.transferred += 1
            for engine in rng.sample(engines, rng.randrange(1, len(engines) + 1)):
                if not engine.has_work:
                    continue
                for out in engine.step():
                    if out.kv_handle is not None:
                        prompt = prefilling.pop(out.request_id)
                        wait = rng.choice([0, 0, 1, 2, 5, 12])
                        handles.append((iteration + wait, out.request_id, prompt, out.kv_handle))
                    elif out.request_id in tokens:
                        tokens[out.request_id] += out.new_token_ids
                        if out.finished:
                            finished.add(out.request_id)
        for index, prompt in enumerate(prompts):
            request_id = f"r{index}"
            result.requests += 1
            want, got = oracle[tuple(prompt)], tokens[request_id]
            if got != want:
                result.wrong_tokens += 1
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
                )
                result.mismatches.append({"request": request_id, "prompt_tokens": len(prompt), "diverged_at": at})
        result.preemptions = sum(e.scheduler.num_preemptions for e in engines)
        result.read_failures = sum(e.worker_view.transfer_stats.failures for e in decode)
        for engine in engines:
            engine.coordinator.check_invariants()
            assert not engine.has_work
            assert engine.coordinator.num_free_blocks == engine.info.num_blocks - 1, f"{engine.name}: blocks leaked"
    finally:
        for engine in engines:
            engine.close()
    result.seconds = round(time.monotonic() - start, 2)
    return result


def duplicate_wave_prompts(seed: int, distinct: int = 16) -> list[list[int]]:
    """``distinct`` prompts of 56 + 17 k tokens (k = 0 ..), the lengths of the serve test's
    64-stream prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(56 + 17 * k)] for k in range(distinct)]


def run_duplicate_waves(
    config,
    prompts: list[list[int]],
    oracle: list[list[int]],
    *,
    waves: int,
    copies: int = 4,
    seed: int = 0,
    decode_only_below: int = 16,
    sampling: SamplingParams = SAMPLING,
) -> EngineStressResult:
    """The serve test's 64 concurrent streams at engine level: one prefill and one decode engine
    (``config``'s transfer backend) kept across ``waves`` waves; each wave sends every prompt
    ``copies`` times, in order or shuffled, in bursts of 1-16. Like the router, a request runs
    whole on the decode engine when that engine's prefix hit leaves fewer than
    ``decode_only_below`` tokens to compute, otherwise it is prefilled and its handle reaches
    the decode engine 0-5 iterations later. Every request's tokens against ``oracle`` (the
    tokens of ``prompts[i]``); engines are closed on return."""
    from engine.core import EngineCore
    from engine.kv_cache.hashing import block_hashes

    result = EngineStressResult(f"{config.model.source}/{config.transfer.backend}/1P1D/duplicate-waves")
    start = time.monotonic()
    prefill = EngineCore(config, name="prefill-0", kv_role="prefill")
    decode = EngineCore(config, name="decode-0", kv_role="decode")
    block_size = config.kv_cache.block_size
    try:
        for wave in range(waves):
            rng = random.Random(seed * 1000 + wave)
            order = [i % len(prompts) for i in range(copies * len(prompts))]
            if rng.random() < 0.5:
                rng.shuffle(order)
            pending = [(f"w{wave}-{n}", index) for n, index in enumerate(order)]
            tokens: dict[str, list[int]] = {}
            prefilling: dict[str, int] = {}
            handles: list[tuple[int, str, int, Any]] = []  # (deliver at iteration, id, prompt index, handle)
            iteration = 0
            while pending or handles or prefill.has_work or decode.has_work:
                iteration += 1
                if pending and rng.random() < 0.6:
                    for _ in range(min(len(pending), rng.randrange(1, 17))):
                        request_id, index = pending.pop(0)
                        prompt = prompts[index]
                        hit = decode.coordinator.find_longest_cache_hit(
                            block_hashes(prompt, block_size), len(prompt) - 1
                        )
                        if len(prompt) - hit.num_tokens < decode_only_below:
                            decode.add_request(request_id, prompt, sampling)
                            tokens[request_id] = []
                            result.colocated += 1
                        else:
                            prefill.add_request(request_id, prompt, sampling, prefill_only=True)
                            prefilling[request_id] = index
                for item in [h for h in handles if h[0] <= iteration]:
                    handles.remove(item)
                    _, request_id, index, handle = item
                    decode.add_request(request_id, prompts[index], sampling, kv_handle=handle)
                    tokens[request_id] = []
                    result.transferred += 1
                for engine in rng.sample([prefill, decode], rng.randrange(1, 3)):
                    if not engine.has_work:
                        continue
                    for out in engine.step():
                        if out.kv_handle is not None:
                            index = prefilling.pop(out.request_id)
                            handles.append(
                                (iteration + rng.choice([0, 0, 1, 2, 5]), out.request_id, index, out.kv_handle)
                            )
                        elif out.request_id in tokens:
                            tokens[out.request_id] += out.new_token_ids
            for request_id, index in ((f"w{wave}-{n}", index) for n, index in enumerate(order)):
                result.requests += 1
                want, got = oracle[index], tokens[request_id]
                if got != want:
                    result.wrong_tokens += 1
                    at = next(
                        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
                    )
                    result.mismatches.append(
                        {"request": request_id, "prompt_tokens": len(prompts[index]), "diverged_at": at}
                    )
        result.preemptions = prefill.scheduler.num_preemptions + decode.scheduler.num_preemptions
        result.read_failures = decode.worker_view.transfer_stats.failures
        for engine in (prefill, decode):
            engine.coordinator.check_invariants()
            assert not engine.has_work
            assert engine.coordinator.num_free_blocks == engine.info.num_blocks - 1, f"{engine.name}: blocks leaked"
    finally:
        prefill.close()
        decode.close()
    result.seconds = round(time.monotonic() - start, 2)
    return result
