"""Decode tokens/s of a Bamba-shaped random model at N running requests, through EngineCore:
the per-request Mamba2 loop ("before", ``engine.model.layers.mamba2_reference.forward_per_request`` in
place of each mixer's forward) against the batched path ("after", ``Mamba2Mixer.forward``), same
engine, same prompts, same run.

Shape: Bamba-9B's proportions scaled to a 2-core CPU (hidden 4096 -> 1024; the MLP stays 3.5x
hidden; Mamba heads keep head_dim 64, d_state 128, 1 group, d_conv 4, expand 2, so 128 -> 32
heads; attention keeps 4 query heads per KV head and head_dim 128; 32 layers with 3 attention ->
8 layers with 1; vocabulary 128k -> 32k). fp32, random weights built through transformers.

Each round adds N requests with ``prompt_len``-token prompts, steps until every one has its first
token (prefill is not timed), then runs ``2 * decode_steps`` steps in which all N requests decode
one token each, switching between the per-request path and the batched one every step, so load
from other processes on a shared machine and the growing sequences hit both alike. Reported: the
median step of each path by wall time (``mamba_decode_speedup``, tokens/s) and by CPU time (with
one thread, what a dedicated core would give when other processes share the machine), and the
time inside the Mamba mixers (forward hooks) to show where a step goes. Standalone: progress on
stderr, and the last stdout line is one JSON object with ``mamba_decode_speedup``.

What bounds the speedup on a CPU: at these proportions one request's Mamba state is 1 MiB per
layer (2 x hidden x d_state fp32), so a decode step must read and write 32 MiB per Mamba layer at
32 requests, in both paths; batching removes the per-request Python and dispatch work, not that
traffic, and the MLP, attention, in/out projections and LM head cost the same before and after.
``speedup_bound_zero_cost_mixers`` reports the step speedup a mixer taking no time at all would
give (Amdahl: the "before" step over its time outside the mixers), the ceiling of any Mamba path.

Last measured: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from configs import load_config
from engine.core import EngineCore
from engine.model.layers.mamba2 import Mamba2Mixer
from engine.model.layers.mamba2_reference import forward_per_request
from engine.sampling_params import SamplingParams

log = logging.getLogger("mamba_decode")

BAMBA_9B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "attn_layer_indices": [9, 18, 27],
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "vocab_size": 128256,
}
BAMBA_SCALED = {
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 8,
    "attn_layer_indices": [4],
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "mamba_n_heads": 32,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build_bamba(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random Bamba checkpoint of ``BAMBA_SCALED`` (plus ``overrides``) to ``directory``."""
    from transformers import BambaConfig, BambaForCausalLM

    torch.manual_seed(seed)
    model = BambaForCausalLM(BambaConfig(**{**BAMBA_SCALED, **overrides})).eval()
    model.save_pretrained(directory)
    log.info("random Bamba: %.1fM parameters in %s", sum(p.numel() for p in model.parameters()) / 1e6, directory)
    return directory


@dataclass
class _Steps:
    """One path's timed decode steps: wall and CPU seconds and seconds inside the Mamba mixers,
    one entry per step (each step decodes one token for every running request)."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    mixer_s: list[float] = field(default_factory=list)

    def per_step(self, name: str) -> float:
        """Median seconds per step of ``name`` ("wall_s", "cpu_s" or "mixer_s")."""
        return statistics.median(getattr(self, name))


class _MixerClock:
    """Wall time spent inside the model's Mamba2 mixers (forward hooks), and their path switch."""

    def __init__(self, engine: EngineCore):
        self.mixers = [m for m in engine.runner.model.modules() if isinstance(m, Mamba2Mixer)]
        self.seconds = 0.0
        self._entered = 0.0
        self._hooks = [
            h
            for m in self.mixers
            for h in (m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._leave))
        ]

    def _enter(self, *_: Any) -> None:
        self._entered = time.perf_counter()

    def _leave(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._entered

    def use_per_request(self, per_request: bool) -> None:
        """Run each mixer's per-request loop (an instance-level forward that ``nn.Module.__call__``
        finds before the class's batched one, hooks included) or its batched forward again."""
        for mixer in self.mixers:
            if per_request:
                mixer.forward = partial(forward_per_request, mixer)
            else:
                vars(mixer).pop("forward", None)

    def close(self) -> None:
        self.use_per_request(False)
        for hook in self._hooks:
            hook.remove()


def _decode_round(
    engine: EngineCore, clock: _MixerClock, prompts: list[list[int]], decode_steps: int, tag: str
) -> dict[str, _Steps]:
    """Prefill ``prompts`` (untimed), then ``2 * decode_steps`` steps in which every request
    decodes one token, alternating the per-request path ("before") and the batched one ("after")
    step by step, so both see the same load and nearly the same sequence lengths."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1 + 2 * decode_steps, ignore_eos=True))
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    steps = {"before": _Steps(), "after": _Steps()}
    for i in range(2 * decode_steps):
        name = "before" if i % 2 == 0 else "after"
        clock.use_per_request(name == "before")
        clock.seconds = 0.0
        wall, cpu = time.perf_counter(), time.process_time()
        decoded = sum(len(out.new_token_ids) for out in engine.step())
        steps[name].wall_s.append(time.perf_counter() - wall)
        steps[name].cpu_s.append(time.process_time() - cpu)
        steps[name].mixer_s.append(clock.seconds)
        if decoded != len(ids):
            raise RuntimeError(f"step {i} decoded {decoded} tokens, expected one per request ({len(ids)})")
    while engine.has_work:  # nothing should be left
        engine.step()
    return steps


def measure_decode(
    model_directory: str | Path | None = None,
    num_requests: int = 32,
    prompt_len: int = 64,
    decode_steps: int = 16,
    rounds: int = 2,
    threads: int = 1,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:
    """Decode tokens/s at ``num_requests`` running requests, per-request Mamba loop vs batched.

    Builds the scaled Bamba checkpoint in a temporary directory unless ``model_directory`` is
    given. Returns ``{"mamba_decode_speedup": before/after median wall seconds per decode step,
    "tokens_per_s": {"before", "after"}, ...}`` over ``rounds`` rounds of ``decode_steps`` steps
    per path (alternating step by step), the same by CPU time (``threads=1``: what a dedicated
    core would give on a shared machine), and the speedup inside the Mamba mixers alone.
    On ``device="cuda"`` the step times are still wall times of whole steps (each ends in the
    sampler's copy of the tokens to the host, so the GPU work is inside them); the mixer times
    and the CPU-time fields only count launch work there.
    """
    if model_directory is None:
        with tempfile.TemporaryDirectory() as tmp:
            return measure_decode(
                build_bamba(Path(tmp) / "bamba", seed),
                num_requests,
                prompt_len,
                decode_steps,
                rounds,
                threads,
                seed,
                device,
                dtype,
            )
    config = load_config(
        "tiny",
        [
            f"model.source={model_directory}",
            f"model.device={device}",
            f"model.dtype={dtype}",
            "kv_cache.block_size=16",
            "kv_cache.num_blocks=null",
            "kv_cache.memory_budget_mib=1024",
            "kv_cache.prefix_caching=false",
            "kv_cache.pinning.enabled=false",
            f"scheduler.max_num_seqs={num_requests}",
            f"scheduler.max_num_batched_tokens={max(2048, prompt_len)}",
            f"scheduler.prefill_chunk_size={prompt_len}",
            # eager steps: the per-request reference reads the eager batch's per-request state
            # indices, which the static (graph) decode step keeps on the device instead
            "model.cuda_graphs=false",
        ],
    )
    engine = EngineCore(config, threads=threads)
    clock = _MixerClock(engine)
    vocab = engine.runner.arch.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num_requests)]
    steps = {"before": _Steps(), "after": _Steps()}
    for r in range(rounds):
        for name, timed in _decode_round(engine, clock, prompts, decode_steps, f"round{r}").items():
            for attribute in ("wall_s", "cpu_s", "mixer_s"):
                getattr(steps[name], attribute).extend(getattr(timed, attribute))
            log.info(
                "round %d %s: median step %.3f s wall, %.3f s CPU, %.3f s in %d Mamba mixers",
                r,
                name,
                timed.per_step("wall_s"),
                timed.per_step("cpu_s"),
                timed.per_step("mixer_s"),
                len(clock.mixers),
            )
    clock.close()
    engine.close()
    before, after = steps["before"], steps["after"]
    return {
        "mamba_decode_speedup": round(before.per_step("wall_s") / after.per_step("wall_s"), 3),
        "tokens_per_s": {k: round(num_requests / v.per_step("wall_s"), 2) for k, v in steps.items()},
        "mamba_decode_speedup_cpu_time": round(before.per_step("cpu_s") / after.per_step("cpu_s"), 3),
        "tokens_per_cpu_s": {k: round(num_requests / v.per_step("cpu_s"), 2) for k, v in steps.items()},
        "mixer_speedup": round(before.per_step("mixer_s") / after.per_step("mixer_s"), 3),
        "mixer_share_of_step_before": round(before.per_step("mixer_s") / before.per_step("wall_s"), 3),
        # the step speedup if the batched mixers took no time at all: the most any Mamba path can give
        "speedup_bound_zero_cost_mixers": round(
            before.per_step("wall_s") / (before.per_step("wall_s") - before.per_step("mixer_s")), 3
        ),
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "decode_steps_per_path": decode_steps * rounds,
        "threads": threads,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": dtype,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=Path, help="keep the built checkpoint here (reused when present)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    directory = args.model_dir
    if directory is not None and not (directory / "config.json").is_file():
        build_bamba(directory, args.seed)
    result = measure_decode(
        directory,
        args.num_requests,
        args.prompt_len,
        args.decode_steps,
        args.rounds,
        args.threads,
        args.seed,
        args.device,
        args.dtype,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
