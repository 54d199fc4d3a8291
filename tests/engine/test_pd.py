"""Prefill/decode disaggregation end to end: a prefill engine in another OS process, a decode
engine here, KV moved by the configured transfer backend.

Oracles: the greedy tokens of one engine that runs the whole request; the block count each
transfer must move, from the per-group rule written out independently below (full attention:
the blocks the decode side did not hit; sliding window: the blocks inside the window at the
transfer point; Mamba: one state block); and the transferred blocks' bytes against the source.
Every engine runs on ``KVFLEET_TEST_DEVICE`` (``tests/support.py``; unset: the presets' cpu).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from engine.core import EngineCore
from engine.kv_cache.spec import MambaSpec, SlidingWindowSpec
from engine.sampling_params import SamplingParams
from tests.engine.pd_proc import prefill_process
from tests.support import load_preset

PRESETS = ["tiny", "tiny-hybrid"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def config(preset: str, backend: str = "local", *overrides: str):
    return load_preset(preset, [f"transfer.backend={backend}", *overrides])


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=PRESETS)
def oracle(request):
    """(preset, a single engine that runs whole requests, its group specs). It runs every step
    eagerly (``model.cuda_graphs=false``), so the P/D decode engines' static, padded decode steps
    are checked against the eager path."""
    engine = EngineCore(config(request.param, "local", "model.cuda_graphs=false"))
    yield request.param, engine, [group.spec for group in engine.coordinator.groups]


def run_to_end(engine: EngineCore, request_ids: set[str], timeout_s: float = 60.0) -> dict[str, tuple[list[int], str]]:
    """Step until every request finished; ``{id: (tokens, finish_reason)}``."""
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    done: dict[str, tuple[list[int], str]] = {}
    end = time.monotonic() + timeout_s
    while len(done) < len(request_ids):
        assert time.monotonic() < end, f"requests not finished: {request_ids - set(done)}"
        for result in engine.step():
            if result.request_id in tokens:
                tokens[result.request_id] += result.new_token_ids
                if result.finished:
                    done[result.request_id] = (tokens[result.request_id], result.finish_reason)
    return done


def reference_tokens(engine: EngineCore, prompt: list[int], sampling: SamplingParams = GREEDY) -> list[int]:
    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, sampling)
    return run_to_end(engine, {rid})[rid][0]


def expected_blocks(specs, num_transferred: int, local_hit: int) -> int:
    """The fewest blocks a transfer of ``num_transferred`` tokens can move, past a local hit."""
    count = 0
    for spec in specs:
        bs = spec.block_size
        if isinstance(spec, MambaSpec):
            count += 1  # the state after the last transferred token
            continue
        first = local_hit // bs
        if isinstance(spec, SlidingWindowSpec):  # the next token attends (q - window, q]
            first = max(first, max(0, num_transferred + 1 - spec.window) // bs)
        count += -(-num_transferred // bs) - first
    return count


def recording(engine: EngineCore, tids: dict[bytes, int] | None = None) -> dict[bytes, list[tuple[int, int]]]:
    """Wrap the engine's ``start_read`` to record the block pairs (and transfer id) of each read."""
    seen: dict[bytes, list[tuple[int, int]]] = {}
    start_read = engine.transfer.start_read

    def record(peer, pairs, notify=b""):
        seen[notify] = [tuple(p) for p in list(pairs)]
        tid = start_read(peer, pairs, notify=notify)
        if tids is not None:
            tids[notify] = tid
        return tid

    engine.transfer.start_read = record  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_pd_matches_single_engine_and_moves_only_needed_blocks(oracle, backend):
    if backend == "nixl":
        pytest.importorskip("nixl")
    preset, single, specs = oracle
    cfg = config(preset, backend)
    batch = prompts(1, [2, 9, 23, 45, 70])
    expected = [reference_tokens(single, p) for p in batch]
    decode = EngineCore(cfg, name="decode", kv_role="decode")
    try:
        baseline = decode.coordinator.num_free_blocks
        tids: dict[bytes, int] = {}
        reads = recording(decode, tids)
        with prefill_process(cfg) as prefill:
            handles = [prefill.prefill(f"r{i}", p) for i, p in enumerate(batch)]
            for i, (prompt, handle) in enumerate(zip(batch, handles, strict=False)):
                assert handle.num_tokens == len(prompt) - 1
                decode.add_request(f"r{i}", prompt, GREEDY, kv_handle=handle)
                assert len(reads[f"r{i}".encode()]) == expected_blocks(specs, len(prompt) - 1, 0), f"prompt {i}"

            # Bytes: once each read is done (and before any decode step writes), every block read
            # equals its source block in the prefill process.
            for i in range(len(handles)):
                pairs = reads[f"r{i}".encode()]
                assert decode.transfer.wait(tids[f"r{i}".encode()], 10) == "done"
                for pool in {p for p, _, _ in pairs}:  # (pool, remote, local): ids of that pool's slots
                    chosen = [(r, loc) for p, r, loc in pairs if p == pool]
                    source = prefill.rows([r for r, _ in chosen])
                    for slot, rows, of in zip(decode.runner.slots, source, decode.layout.slot_pool, strict=True):
                        if of == pool:
                            assert torch.equal(slot[[loc for _, loc in chosen]].cpu(), rows), f"prompt {i}"

            results = run_to_end(decode, {f"r{i}" for i in range(len(batch))})
            for i, prompt in enumerate(batch):
                assert results[f"r{i}"][0] == expected[i], f"prompt {i} ({len(prompt)} tokens)"
            assert decode.worker_view.transfer_stats.failures == 0
            assert decode.worker_view.transfer_stats.blocks == sum(expected_blocks(specs, len(p) - 1, 0) for p in batch)

            free, held = prefill.wait_released()
            assert held == 0 and free == prefill.baseline_free  # freed on the reads' notifications
        assert decode.coordinator.num_free_blocks == baseline
        assert not decode.has_work
    finally:
        decode.close()


def test_partial_local_hit_moves_only_missing_blocks(oracle):
    preset, single, specs = oracle
    cfg = config(preset)
    shared, suffix = prompts(2, [32, 13])
    prompt = shared + suffix
    expected = reference_tokens(single, prompt)
    decode = EngineCore(cfg, name="decode", kv_role="decode")
    try:
        baseline = decode.coordinator.num_free_blocks
        reads = recording(decode)
        decode.add_request("warm", [*shared, 7], SamplingParams(max_tokens=1))  # caches the shared 32 tokens
        run_to_end(decode, {"warm"})
        with prefill_process(cfg) as prefill:
            handle = prefill.prefill("r", prompt)
            hits_before = decode.scheduler.hit_tokens
            decode.add_request("r", prompt, GREEDY, kv_handle=handle)
            assert decode.scheduler.hit_tokens - hits_before == 32
            assert run_to_end(decode, {"r"})["r"][0] == expected
            moved = len(reads[b"r"])
            assert moved == expected_blocks(specs, len(prompt) - 1, 32)
            assert moved < expected_blocks(specs, len(prompt) - 1, 0)
            assert prefill.wait_released() == (prefill.baseline_free, 0)
        assert decode.coordinator.num_free_blocks == baseline
    finally:
        decode.close()


@pytest.mark.parametrize("backend", ["local", "nixl"])
@pytest.mark.parametrize("when", ["before_read", "after_start"])
def test_killed_prefill_owner_means_recompute(oracle, backend, when):
    if backend == "nixl":
        pytest.importorskip("nixl")
    preset, single, _ = oracle
    cfg = config(preset, backend, "transfer.read_timeout_s=1", "transfer.release_timeout_s=2")
    prompt, other = prompts(3, [41, 18])
    expected, expected_other = reference_tokens(single, prompt), reference_tokens(single, other)
    decode = EngineCore(cfg, name="decode", kv_role="decode")
    try:
        baseline = decode.coordinator.num_free_blocks
        with prefill_process(cfg) as prefill:
            handle = prefill.prefill("r", prompt)
            if when == "before_read":
                prefill.kill()
            decode.add_request("r", prompt, GREEDY, kv_handle=handle)
            if when == "after_start":
                prefill.kill()
            assert run_to_end(decode, {"r"})["r"] == (expected, "length")
        stats = decode.worker_view.transfer_stats
        if when == "before_read":
            assert stats.failures == 1 and stats.blocks == 0  # the read failed and the request was recomputed
        else:
            assert stats.failures + (stats.blocks > 0) == 1  # either the read won the race or it was recomputed
        assert decode.coordinator.num_free_blocks == baseline
        decode.add_request("after", other, GREEDY)  # and the decode engine keeps serving
        assert run_to_end(decode, {"after"})["after"][0] == expected_other
        assert decode.coordinator.num_free_blocks == baseline and not decode.has_work
    finally:
        decode.close()


def test_prefill_frees_held_blocks_when_no_reader_comes():
    cfg = config("tiny", "local", "transfer.read_timeout_s=0.2", "transfer.release_timeout_s=0.5")
    prefill = EngineCore(cfg, name="prefill", kv_role="prefill")
    try:
        baseline = prefill.coordinator.num_free_blocks
        prefill.add_request("r", prompts(4, [30])[0], GREEDY, prefill_only=True)
        (result,) = run_to_end(prefill, {"r"}).values()
        assert result[1] == "remote_decode"
        assert prefill.coordinator.num_free_blocks < baseline and len(prefill.worker_view.held) == 1
        end = time.monotonic() + 5
        while prefill.has_work and time.monotonic() < end:
            prefill.step()
            time.sleep(0.01)
        assert prefill.worker_view.transfer_stats.released_by_timeout == 1
        assert prefill.coordinator.num_free_blocks == baseline and not prefill.has_work
    finally:
        prefill.close()


def engines(cfg):
    return EngineCore(cfg, name="prefill", kv_role="prefill"), EngineCore(cfg, name="decode", kv_role="decode")


def prefill_in_process(engine: EngineCore, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, GREEDY, prefill_only=True)
    results = []
    while not results:
        results = [r for r in engine.step() if r.request_id == request_id and r.finished]
    return results[0].kv_handle


def test_failure_with_on_failure_fail_reports_error_and_frees():
    cfg = config("tiny", "local", "transfer.on_failure=fail", "transfer.read_timeout_s=0.5")
    prefill, decode = engines(cfg)
    try:
        baseline = decode.coordinator.num_free_blocks
        prompt = prompts(5, [26])[0]
        handle = prefill_in_process(prefill, "r", prompt)
        prefill.close()  # the owner's memory and socket are gone
        decode.add_request("r", prompt, GREEDY, kv_handle=handle)
        assert run_to_end(decode, {"r"})["r"] == ([], "error")
        assert decode.coordinator.num_free_blocks == baseline and not decode.has_work
    finally:
        decode.close()


def test_abort_while_loading_frees_after_the_read_ends(oracle):
    preset, _, _ = oracle
    prefill, decode = engines(config(preset))
    try:
        baselines = prefill.coordinator.num_free_blocks, decode.coordinator.num_free_blocks
        prompt = prompts(6, [37])[0]
        handle = prefill_in_process(prefill, "r", prompt)
        decode.add_request("r", prompt, GREEDY, kv_handle=handle)
        assert decode.abort("r")
        end = time.monotonic() + 5
        while (decode.has_work or prefill.has_work) and time.monotonic() < end:
            decode.step()
            prefill.step()
        assert (prefill.coordinator.num_free_blocks, decode.coordinator.num_free_blocks) == baselines
    finally:
        prefill.close()
        decode.close()


def test_full_local_hit_reads_nothing_but_still_releases_the_owner(oracle):
    preset, single, _ = oracle
    prefill, decode = engines(config(preset))
    try:
        prompt = prompts(7, [33])[0]
        expected = reference_tokens(single, prompt)
        decode.add_request("warm", prompt, SamplingParams(max_tokens=1))
        run_to_end(decode, {"warm"})
        handle = prefill_in_process(prefill, "r", prompt)
        decode.add_request("r", prompt, GREEDY, kv_handle=handle)
        assert run_to_end(decode, {"r"})["r"][0] == expected
        assert decode.worker_view.transfer_stats.reads == 0 and decode.worker_view.transfer_stats.notify_only == 1
        end = time.monotonic() + 5
        while prefill.has_work and time.monotonic() < end:
            prefill.step()
        assert prefill.worker_view.transfer_stats.released_by_notification == 1 and not prefill.worker_view.held
    finally:
        prefill.close()
        decode.close()


def test_bad_handles_and_requests_get_clear_errors():
    cfg = config("tiny")
    prefill, decode = engines(cfg)
    plain = EngineCore(cfg)
    try:
        prompt = prompts(8, [20])[0]
        handle = prefill_in_process(prefill, "r", prompt)
        with pytest.raises(ValueError, match=r"kv_handle.num_tokens"):
            decode.add_request("x", [*prompt, 5], GREEDY, kv_handle=handle)
        with pytest.raises(ValueError, match=r"kv_handle.token_digest"):
            decode.add_request("x", [9, *prompt[1:]], GREEDY, kv_handle=handle)
        with pytest.raises(ValueError, match="prompt_token_ids: a prefill-only request needs >= 2 tokens"):
            prefill.add_request("one", [5], GREEDY, prefill_only=True)
        with pytest.raises(ValueError, match="kv_role"):
            plain.add_request("x", prompt, GREEDY, kv_handle=handle)
        hybrid = EngineCore(config("tiny-hybrid"), name="hybrid", kv_role="decode")
        try:
            with pytest.raises(ValueError, match=r"kv_handle.layout_key"):
                hybrid.add_request("x", prompt, GREEDY, kv_handle=handle)
        finally:
            hybrid.close()
        assert not decode.has_work  # nothing was admitted by the rejected calls
    finally:
        prefill.close()
        decode.close()


def test_a_constrained_request_whose_handle_fails_leaves_no_grammar_matcher_behind():
    """A structured-output request announced on the decode side registers a matcher; a handle
    that does not fit ends the request there, and the runner forgets its matcher too."""
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar (the test extra has it)")
    from engine.sampling_params import StructuredOutput

    cfg = config("tiny")
    prefill, decode = engines(cfg)
    try:
        prompt = prompts(9, [20])[0]
        handle = prefill_in_process(prefill, "r", prompt)
        constrained = GREEDY.replace(structured=StructuredOutput(kind="choice", spec='["yes", "no"]'))
        decode.expect_remote_prefill("x", [9, *prompt[1:]], constrained)
        assert "x" in decode.runner.structured
        ended = decode.provide_handle("x", handle)
        assert ended is not None and ended.finish_reason == "error" and "kv_handle.token_digest" in (ended.error or "")
        assert "x" not in decode.runner.structured
        end = time.monotonic() + 5  # the owner's notification goes out; nothing else runs
        while decode.has_work and time.monotonic() < end:
            assert decode.step() == []
        assert not decode.has_work and decode.coordinator.num_free_blocks == decode.info.num_blocks - 1
    finally:
        prefill.close()
        decode.close()
