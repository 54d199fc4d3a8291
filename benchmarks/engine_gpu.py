"""kvfleet's EngineCore on one GPU against Hugging Face ``generate``, and its decode step against
the memory-bandwidth bound, same device, same dtype (bfloat16 on CUDA), one run.

Models (random weights through engine.model.checkpoints.random_checkpoint, initialised on the device, saved in
the run's dtype to a temporary directory): ``gemma`` — Gemma-3-270M's published shape (268.1M
parameters; engine.model.checkpoints.gguf_named_models' expected config: vocab 262144, hidden
640, 18 layers, 4 query / 1 KV heads of 256, sliding window 512, 5 local : 1 global, rope theta
1e4 local / 1e6 global, tied embeddings; MLP 2048, query_pre_attn_scalar 256); ``bamba`` —
Bamba-9B's proportions (benchmarks/mamba_decode.py's ``BAMBA_SCALED``) at hidden 1536, 10 layers
with attention at layers 3 and 7 (12 query / 3 KV heads of 128), 48 Mamba2 heads of 64, d_state
128, MLP 5376, vocabulary 32000 (475.0M parameters). On a CPU in bfloat16 both give the same
greedy tokens in kvfleet and in HF.

(1) Throughput on the mixed-length request mix (benchmarks/support/hf_generate.py:
    ``--num-requests`` (64) requests, prompts uniform in [64, 1024] tokens, outputs uniform in
    [16, 256], seeded). kvfleet receives every request at once (64 running, 8192 tokens per step,
    1024-token prefill chunks, KV budget large enough that nothing is preempted: ``preemptions``
    says); HF ``generate`` runs them greedily in left-padded batches of 16, each row kept going to
    its batch's longest max_tokens, and is credited only each request's own max_tokens. Output
    tokens/s = useful output tokens / wall seconds; ``throughput_ratio_vs_hf`` = kvfleet / HF.
(2) Time to first token, all requests arriving at t=0. kvfleet: per request, from the first
    ``add_request`` to the end of the ``step()`` that returned its first token (p50 and mean).
    HF: per request, its batch's start in the throughput run plus that batch's prefill time,
    measured separately afterwards as a 1-new-token ``generate`` of the same batch (device
    synchronised before and after); ``batch_prefill_mean`` is that 1-token time alone.
(3) Decode step time at batch 1, 8, 64 (kvfleet, gemma): B requests of a 512-token prompt are
    prefilled (untimed), 3 decode steps run untimed, then 32 ``step()`` calls, each decoding one
    token for all B, are timed with perf_counter between device synchronisations; ms/step. The
    bound: bytes a step must read (every weight once in the model dtype, tied embeddings once,
    plus each request's K and V for every attention layer over min(context, window) tokens,
    averaged over the timed steps) over the device's copy bandwidth, measured in the same run
    (best of 20 copies of a 1 GiB tensor, bytes read + written / time, CUDA events).
    ``decode_step_over_bound`` = measured step / bound (1.0 would be a step that only streams
    its bytes at copy speed).

Both systems are warmed up first (kvfleet: 16 short requests through the same engine; HF: one
short batch), so CUDA initialisation and kernel selection are not timed. ``--max-seconds`` (180)
bounds the run: a phase that would start, or a loop that goes on, past it is skipped and named
in ``errors``; every phase that fails is recorded there and the others still run. Progress on
stderr (logging); the last stdout line is one JSON object::

  {"throughput_ratio_vs_hf": {"gemma": r, "bamba": r}, "decode_step_over_bound": {"1": r, "8": r,
   "64": r}, "device": "<GPU name>", "tokens_per_s": ..., "ttft_s": ..., "decode_step_ms": ...,
   "decode_bound_ms": ..., "copy_bandwidth_gb_s": ..., "host_step_ms": {"1": ms, ...},
   "host_phases_ms": {...}, "kernels_per_step": {...}, "kernel_ms_per_step": {...}, "kernel_top": {...},
   "output_tokens_per_s": {"gemma": n, "bamba": n}, "graph_capture": {...}, "eager_steps": {...},
   "decode_step_ms_eager": {...}, "ops_per_step": {"gemma": n, "bamba": n}, ...}

(4) Host work and kernels of the decode steps of (3) (``benchmarks/support/step_phases.py``): each
    timed step is run again with its phases timed (schedule, batch build, forward or graph
    launch, logits, sample, update); ``host_step_ms`` is the median over steps of wall time minus
    forward and logits. On CUDA, 5 more steps under torch.profiler give the kernels per step,
    their summed device time and the ten kernels that take the most of it (``kernel_top``: name,
    launches and µs per step), and (``--no-eager-decode`` skips it) a second engine with
    ``model.cuda_graphs=false`` repeats (3) and (4) (``*_eager`` keys).
(5) ``ops_per_step``: the device operations one decode step's model forward and logits dispatch
    (``benchmarks/support/op_count.py``), batch 1, counted on each model's FULL shape even in a
    ``--quick`` run (the full checkpoint is built for it there), uncaptured (a graph replay
    dispatches nothing to count), on the engine's fused path
    (``op_count.fused_path``: every Triton kernel of engine/model/kernels/ switched on; on a CPU
    they run under Triton's interpreter, so this count takes minutes there, and ``--max-seconds``
    does not bound it). How it counts: a
    ``TorchDispatchMode`` sees each aten operator once (views, metadata and bare allocations
    left out), and each Triton launch counts one (``triton::<kernel>``) with what the launch
    itself dispatches left out; ``ops_by_op`` lists the most frequent. On CUDA it stands beside
    the profiler's ``kernels_per_step``, which checks the proxy. Measured 2026-11-29 (CPU):
    gemma 184, bamba 111 (196 and 117 before the rotary tables, the same on an H200, where the
    profiler counted 210 kernels a captured step; the torch path's count: 723 and 516).
(6) ``eager_steps``: steps of the timed mix (1) that took the eager forward over a freshly
    built batch (``ModelRunner.eager_steps``): neither the static decode step nor the static
    token-bucket step of prefill and mixed steps (``engine.model.mixed_step``) served them; 0 is
    the goal. ``graph_capture``: per model, what capturing cost: the decode graphs
    (``seconds``, ``mib``, ``buckets``) and the mixed step's piecewise graphs (``mixed_seconds``,
    ``mixed_mib``, ``mixed_buckets``; CUDA memory reserved by the capture, wall seconds).
(7) ``--async-scheduling``: every kvfleet engine runs with ``scheduler.async_scheduling=true``
    (each step, decode, prefill or mixed, scheduled and launched while the step before runs);
    ``async_scheduling`` says per model whether its engine did, ``overlapped_steps`` the steps so
    launched (``steps``) and those holding a prompt chunk (``prompt_steps``), warm-up included
    (``EngineCounters``).

On the GPU machine: ``python -m benchmarks.engine_gpu`` (``--device cuda``, bfloat16; expected
about three minutes). Smoke run on a CPU (tiny shapes, 8 requests, decode batches 1, 8 and 64, about
10 s): ``python -m benchmarks.engine_gpu --device cpu --dtype float32 --quick``. The CPU numbers
mean nothing (the shapes are tiny and the machine shared), except the host phases of
``--device cpu --quick`` (decode batches 1, 8 and 64): ``host_step_ms`` is the host work of a step
around the model. Last measured on an H200: benchmarks/README.md and
benchmarks/results/engine_gpu-h200-2026-11-27-*.json.

Code: this script is the entry point (the kvfleet and Hugging Face sides, one model, arguments,
main, the report); the models, sizes, run state and checkpoints are in
``benchmarks/support/gpu_bench_setup.py`` and the decode step against its bound in
``benchmarks/support/gpu_bench_decode.py``. Every moved name is still importable from here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.support.gpu_bench_decode import (
    copy_bandwidth,
    record_decode,
    weight_bytes,
)
from benchmarks.support.gpu_bench_setup import (
    DECODE_MODEL,
    MODELS,
    QUICK,
    QUICK_MODELS,
    Run,
    Sizes,
    build_checkpoint,
)
from benchmarks.support.hf_generate import generate_batch, workload
from benchmarks.support.op_count import decode_ops, fused_path
from configs import load_config
from engine.core import EngineCore
from engine.runner import TORCH_DTYPES
from engine.sampling_params import SamplingParams

log = logging.getLogger("engine_gpu")


# -- kvfleet ----------------------------------------------------------------------------------------------
def make_engine(run: Run, directory: Path, graphs: bool = True) -> EngineCore:
    """The benchmark's engine; ``graphs``: ``model.cuda_graphs`` (static, padded decode steps,
    captured on CUDA) or eager steps."""
    sizes = run.sizes
    config = load_config(
        "local",
        [
            f"model.source={directory}",
            f"model.device={run.device.type}",
            f"model.dtype={run.args.dtype}",
            "kv_cache.num_blocks=null",
            f"kv_cache.memory_budget_mib={sizes.kv_budget_mib}",
            "kv_cache.pinning.enabled=false",
            f"scheduler.max_num_seqs={max(sizes.max_num_seqs, *sizes.decode_batches)}",
            f"scheduler.max_num_batched_tokens={sizes.max_num_batched_tokens}",
            f"scheduler.prefill_chunk_size={sizes.prefill_chunk_size}",
            f"model.cuda_graphs={str(graphs).lower()}",
            f"scheduler.async_scheduling={str(run.args.async_scheduling).lower()}",
        ],
    )
    return EngineCore(config, threads=run.args.threads if run.device.type == "cpu" else None)


def run_kvfleet(run: Run, engine: EngineCore, requests: list[tuple[list[int], int]], tag: str) -> dict[str, Any]:
    """All ``requests`` added at once, stepped to the end: wall seconds, output tokens, and each
    request's seconds to its first token (from the first add to the end of that step)."""
    run.sync()
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    first: dict[str, float] = {}
    produced = steps = 0
    errors = []
    while engine.has_work:
        outputs = engine.step()
        now = time.perf_counter() - start
        steps += 1
        for out in outputs:
            if out.new_token_ids:
                produced += len(out.new_token_ids)
                first.setdefault(out.request_id, now)
            if out.error:
                errors.append(f"{out.request_id}: {out.error}")
        if steps % 100 == 0:
            log.info("kvfleet %s: step %d, %d tokens, %.1f s", tag, steps, produced, now)
        run.check(f"kvfleet {tag}")
    run.sync()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"kvfleet {tag}: {len(errors)} requests failed, first: {errors[0]}")
    return {"wall_s": wall, "tokens": produced, "steps": steps, "ttft_s": list(first.values())}


def warmup_kvfleet(run: Run, engine: EngineCore, vocab: int) -> None:
    """Short requests of other tokens than the measured ones (no prefix hits carry over)."""
    sizes = run.sizes
    rng = random.Random(run.args.seed + 1)
    prompts = [
        ([rng.randrange(3, vocab) for _ in range(sizes.warmup_prompt_len)], sizes.warmup_tokens)
        for _ in range(sizes.warmup_requests)
    ]
    run_kvfleet(run, engine, prompts, "warmup")


def kvfleet_side(run: Run, name: str, directory: Path, requests: list[tuple[list[int], int]], vocab: int) -> dict:
    """Warm-up and throughput run of one engine, then (for ``DECODE_MODEL``) its decode steps."""
    engine = make_engine(run, directory)
    try:
        run.result["weight_bytes"][name] = weight_bytes(engine.runner.model)
        decode, mixed = engine.runner.decode, engine.runner.mixed
        capture: dict[str, Any] = {}
        if decode is not None and decode.captured:
            capture.update(
                seconds=round(decode.capture_seconds, 3),
                mib=round(decode.capture_bytes / 2**20, 1),
                buckets=len(decode.buckets),
            )
        if mixed is not None and mixed.captured:  # prefill and mixed steps: piecewise graphs per token bucket
            capture.update(
                mixed_seconds=round(mixed.capture_seconds, 3),
                mixed_mib=round(mixed.capture_bytes / 2**20, 1),
                mixed_buckets=len(mixed.buckets),
            )
        if capture:
            run.result["graph_capture"][name] = capture
        warmup_kvfleet(run, engine, vocab)
        eager_before = engine.runner.eager_steps
        timed = run_kvfleet(run, engine, requests, "r")
        run.result["eager_steps"][name] = engine.runner.eager_steps - eager_before
        run.result["async_scheduling"][name] = engine.async_scheduling
        if engine.async_scheduling:  # counters since the engine was built (warm-up included)
            counters = engine.counters
            run.result["overlapped_steps"][name] = {
                "steps": counters.overlapped_steps,
                "prompt_steps": counters.overlapped_prompt_steps,
            }
        run.result["preemptions"][name] = engine.scheduler.num_preemptions
        log.info(
            "%s kvfleet: %d tokens in %.2f s (%d steps, %.1f tok/s)",
            name,
            timed["tokens"],
            timed["wall_s"],
            timed["steps"],
            timed["tokens"] / timed["wall_s"],
        )
        if name == DECODE_MODEL and run.args.decode:
            for batch in run.sizes.decode_batches:
                run.attempt(f"decode batch {batch}", lambda b=batch, e=engine: record_decode(run, e, name, b, vocab))
        return timed
    finally:
        engine.close()
        del engine
        run.release_memory()


def eager_decode_side(run: Run, name: str, directory: Path, vocab: int) -> None:
    """The decode steps again with ``model.cuda_graphs=false`` (every step built and run eagerly)."""
    engine = make_engine(run, directory, graphs=False)
    try:
        warmup_kvfleet(run, engine, vocab)
        for batch in run.sizes.decode_batches:
            run.attempt(f"eager decode batch {batch}", lambda b=batch, e=engine: record_decode(run, e, name, b, vocab))
    finally:
        engine.close()
        del engine
        run.release_memory()


# -- Hugging Face -----------------------------------------------------------------------------------------
def hf_side(run: Run, directory: Path, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Warm up, then ``generate`` in left-padded batches (wall, useful tokens, each batch's start),
    then each batch's 1-new-token time."""
    from transformers import AutoModelForCausalLM

    sizes = run.sizes
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=TORCH_DTYPES[run.args.dtype]).to(run.device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = [requests[lo : lo + sizes.hf_batch] for lo in range(0, len(requests), sizes.hf_batch)]
    generate_batch(model, [(p[: sizes.warmup_prompt_len], 1) for p, _ in batches[0]], pad, sizes.warmup_tokens)
    run.sync()
    starts = []
    useful = 0
    start = time.perf_counter()
    for b, group in enumerate(batches):
        run.check("hf generate")
        starts.append(time.perf_counter() - start)
        generate_batch(model, group, pad)
        run.sync()
        useful += sum(m for _, m in group)
        log.info("hf: batch %d/%d done, %.1f s", b + 1, len(batches), time.perf_counter() - start)
    wall = time.perf_counter() - start
    prefill = []
    for group in batches:
        run.check("hf first token")
        run.sync()
        begin = time.perf_counter()
        generate_batch(model, group, pad, new_tokens=1)
        run.sync()
        prefill.append(time.perf_counter() - begin)
    ttft = [starts[b] + prefill[b] for b, group in enumerate(batches) for _ in group]
    del model
    run.release_memory()
    return {"wall_s": wall, "tokens": useful, "ttft_s": ttft, "batch_prefill_s": prefill}


# -- one model -------------------------------------------------------------------------------------------
def ttft_summary(values: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values), 4), "mean": round(statistics.fmean(values), 4)}


def bench_model(run: Run, name: str, directory: Path) -> None:
    """Both systems on one model's checkpoint; fills the result's per-model fields."""
    result = run.result
    vocab = (QUICK_MODELS[name] if run.args.quick else MODELS[name][2])["vocab_size"]
    requests = workload(run.sizes.num_requests, vocab, run.args.seed, run.sizes.prompt_lens, run.sizes.output_lens)
    kvfleet = run.attempt(f"{name} kvfleet", lambda: kvfleet_side(run, name, directory, requests, vocab))
    if name == DECODE_MODEL and run.args.decode and run.args.eager_decode and run.device.type == "cuda":
        run.attempt(f"{name} eager decode", lambda: eager_decode_side(run, name, directory, vocab))
    hf = run.attempt(f"{name} hf", lambda: hf_side(run, directory, requests))
    rates = {}
    for system, timed in (("kvfleet", kvfleet), ("hf", hf)):
        if timed is None:
            continue
        rates[system] = timed["tokens"] / timed["wall_s"]
        result["tokens_per_s"].setdefault(name, {})[system] = round(rates[system], 2)
        if system == "kvfleet":
            result["output_tokens_per_s"][name] = round(rates[system], 2)
        result["wall_s"].setdefault(name, {})[system] = round(timed["wall_s"], 3)
        result["output_tokens"].setdefault(name, {})[system] = timed["tokens"]
        result["ttft_s"].setdefault(name, {})[system] = ttft_summary(timed["ttft_s"])
    if hf is not None:
        result["ttft_s"][name]["hf"]["batch_prefill_mean"] = round(statistics.fmean(hf["batch_prefill_s"]), 4)
    if len(rates) == 2:
        result["throughput_ratio_vs_hf"][name] = round(rates["kvfleet"] / rates["hf"], 3)
        log.info(
            "%s: kvfleet %.1f tok/s, hf %.1f tok/s, ratio %.3f",
            name,
            rates["kvfleet"],
            rates["hf"],
            result["throughput_ratio_vs_hf"][name],
        )


def count_ops(run: Run, name: str, directory: Path) -> None:
    """``ops_per_step[name]``: one batch-1 decode step's device operations on the full shape
    (``directory`` holds it), in an engine sized for that one request."""
    one = replace(run.sizes, max_num_seqs=1, decode_batches=(1,), kv_budget_mib=max(run.sizes.kv_budget_mib, 512))
    with fused_path(run.device.type):
        # uncaptured: a captured decode step replays its graph, which dispatches nothing to count
        engine = make_engine(replace(run, sizes=one), directory, graphs=False)
        vocab = MODELS[name][2]["vocab_size"]
        counted = decode_ops(engine, vocab, prompt_len=8)  # short: the CPU interprets the prefill's kernels
    run.result["ops_per_step"][name] = counted["ops"]
    run.result["ops_by_op"][name] = dict(list(counted["by_op"].items())[:12])
    log.info("%s: %d device operations per decode step (full shape)", name, counted["ops"])
    del engine
    run.release_memory()


def full_shape_ops(run: Run, name: str, tmp: Path) -> None:
    """``count_ops`` on a full-shape checkpoint built for it (a ``--quick`` run's are tiny)."""
    directory = build_checkpoint(run, name, tmp / f"{name}-full", full=True)
    try:
        count_ops(run, name, directory)
    finally:
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gemma,bamba", help="comma-separated: gemma, bamba")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", choices=sorted(TORCH_DTYPES), help="default: bfloat16 on cuda, else float32")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few requests (a CPU smoke run)")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--hf-batch", type=int)
    ap.add_argument("--decode-batches", help="comma-separated batch sizes (default 1,8,64)")
    ap.add_argument("--decode-prompt-len", type=int)
    ap.add_argument("--decode-steps", type=int)
    ap.add_argument("--kv-budget-mib", type=int)
    ap.add_argument("--no-decode", dest="decode", action="store_false", help="skip the decode-step measurement")
    ap.add_argument(
        "--no-eager-decode",
        dest="eager_decode",
        action="store_false",
        help="CUDA: skip the decode steps with model.cuda_graphs=false",
    )
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="scheduler.async_scheduling=true: each step scheduled and launched while the one before runs",
    )
    ap.add_argument("--max-seconds", type=float, default=180.0, help="skip phases that would run past this")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (CPU only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"--models: unknown {sorted(unknown)} (known: {', '.join(MODELS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu)")
    return args


def sizes_from(args: argparse.Namespace) -> Sizes:
    """``--quick``'s or the full sizes, with the sizes given on the command line."""
    given = {f.name: getattr(args, f.name) for f in fields(Sizes) if getattr(args, f.name, None) is not None}
    if args.decode_batches:
        given["decode_batches"] = tuple(int(b) for b in args.decode_batches.split(","))
    return replace(QUICK if args.quick else Sizes(), **given)


CACHE_ENV = "KVFLEET_CACHE"  # a folder, not a kernel choice


def main() -> None:
    args = parse_args()
    if args.device == "cpu":  # ops_per_step runs the Triton kernels interpreted (before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    import transformers

    start = time.perf_counter()
    device = torch.device(args.device)
    sizes = sizes_from(args)
    torch.manual_seed(args.seed)
    result: dict[str, Any] = {
        "throughput_ratio_vs_hf": {},
        "decode_step_over_bound": {},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "tokens_per_s": {},
        "wall_s": {},
        "output_tokens": {},
        "ttft_s": {},
        "preemptions": {},
        "decode_step_ms": {},
        "decode_bound_ms": {},
        "decode_kv_bytes_per_step": {},
        "weight_bytes": {},
        "host_step_ms": {},
        "host_phases_ms": {},
        "kernels_per_step": {},
        "kernel_ms_per_step": {},
        "kernel_top": {},
        "output_tokens_per_s": {},
        "graph_capture": {},
        "eager_steps": {},
        "async_scheduling": {},
        "overlapped_steps": {},
        "decode_step_ms_eager": {},
        "host_phases_ms_eager": {},
        "kernels_per_step_eager": {},
        "ops_per_step": {},
        "ops_by_op": {},
        "num_requests": sizes.num_requests,
        "hf_batch": sizes.hf_batch,
        "quick": args.quick,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        # the kernel choices set in the environment (KVFLEET_SPLIT_DECODE, KVFLEET_SSD_KERNEL ...):
        # which variant this run measured
        "kernel_env": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith("KVFLEET_") and k != "KVFLEET_CACHE"
        },
        "errors": {},
    }
    run = Run(args, sizes, device, start + args.max_seconds, result)
    bandwidth = run.attempt("copy bandwidth", lambda: copy_bandwidth(run))
    if bandwidth:
        result["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
        log.info("device copy bandwidth: %.1f GB/s (read + written)", bandwidth / 1e9)
    with tempfile.TemporaryDirectory(prefix="engine_gpu-") as tmp:
        for name in args.models.split(","):
            directory = run.attempt(f"{name} checkpoint", lambda n=name: build_checkpoint(run, n, Path(tmp) / n))
            if directory is not None:
                bench_model(run, name, directory)
                if not args.quick:
                    run.attempt(f"{name} ops", lambda n=name, d=directory: count_ops(run, n, d))
        counting = replace(run, end=float("inf"))  # the counts are fixed work, not bounded by --max-seconds
        for name in args.models.split(",") if args.quick else ():
            counting.attempt(f"{name} ops", lambda n=name: full_shape_ops(counting, n, Path(tmp)))
    result["total_s"] = round(time.perf_counter() - start, 1)
    log.info("done in %.1f s", result["total_s"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
