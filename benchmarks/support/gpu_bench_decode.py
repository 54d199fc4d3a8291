"""The decode-step side of ``benchmarks/engine_gpu.py``: a step's time against the memory-bandwidth
bound.

Owns the bytes a decode step must read (every weight once, ``weight_bytes``; each request's K and V
for every attention layer, ``kv_bytes_read``), the timed decode steps of ``B`` requests
(``decode_step_time``), their entry in the result with the bound (``record_decode``), and the
device's copy bandwidth the bound is taken at (``copy_bandwidth``).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import torch

from benchmarks.support.gpu_bench_setup import Run
from benchmarks.support.step_phases import StepPhases
from engine.core import EngineCore
from engine.sampling_params import SamplingParams

log = logging.getLogger("engine_gpu")  # the script's logger: progress reads as it did


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter once (tied tensors counted once), in their stored dtype."""
    seen: dict[int, int] = {}
    for param in model.parameters():
        seen[param.data_ptr()] = max(seen.get(param.data_ptr(), 0), param.numel() * param.element_size())
    return sum(seen.values())


def kv_bytes_read(engine: EngineCore, context: int) -> int:
    """Bytes of K and V one decode step reads for a request attending ``context`` tokens."""
    arch = engine.runner.arch
    per_token = 2 * arch.num_kv_heads * arch.head_dim * engine.runner.dtype.itemsize
    total = 0
    for layer in arch.layers:
        if layer.kind in ("full_attention", "sliding_attention"):
            total += per_token * (min(context, layer.window) if layer.window else context)
    return total


def decode_step_time(run: Run, engine: EngineCore, batch: int, vocab: int) -> dict[str, Any]:
    """Milliseconds per decode step with ``batch`` requests decoding, and the KV bytes each step read."""
    sizes = run.sizes
    rng = random.Random(run.args.seed + 100 + batch)
    ids = [f"decode{batch}-{i}" for i in range(batch)]
    # room for the steps while later requests still prefill; every request is aborted after timing
    # warm-up, timed and phase-timed steps, the profiled ones, then 64 to spare
    max_tokens = sizes.decode_warmup_steps + 2 * sizes.decode_steps + sizes.profile_steps + 64
    for rid in ids:
        prompt = [rng.randrange(3, vocab) for _ in range(sizes.decode_prompt_len)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
        run.check(f"decode batch {batch} prefill")
    for _ in range(sizes.decode_warmup_steps):
        engine.step()
    lengths = [engine.scheduler.requests[rid].num_tokens for rid in ids]
    run.sync()
    start = time.perf_counter()
    for k in range(sizes.decode_steps):
        decoded = sum(len(out.new_token_ids) for out in engine.step())
        if decoded != batch:
            raise RuntimeError(f"decode batch {batch}: step {k} decoded {decoded} tokens, expected {batch}")
    run.sync()
    step_s = (time.perf_counter() - start) / sizes.decode_steps
    phases = StepPhases(engine)  # the same steps again, each phase timed (a few us of wrappers each)
    for _ in range(sizes.decode_steps):
        phases.step()
    run.sync()
    kernels = kernel_profile(run, engine, sizes.profile_steps) if run.device.type == "cuda" else {}
    kv = sum(kv_bytes_read(engine, n + k) for n in lengths for k in range(sizes.decode_steps)) / sizes.decode_steps
    for rid in ids:
        engine.abort(rid)
    while engine.has_work:
        engine.step()
    return {
        "step_ms": step_s * 1e3,
        "kv_bytes": kv,
        "context_start": min(lengths),
        "phases": phases.summary(),
        **kernels,
    }


def kernel_profile(run: Run, engine: EngineCore, steps: int) -> dict[str, Any]:
    """CUDA kernels per decode step, their summed milliseconds and the ten that take the most time
    (torch.profiler, ``steps`` steps): ``kernel_top`` rows ``[name, launches per step, µs per
    step]``, the name cut to 70 characters."""
    from torch.profiler import ProfilerActivity, profile

    run.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        run.sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and _is_kernel(e.name)]
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        entry = by_name.setdefault(event.name[:70], [0.0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:10]
    return {
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms_per_step": sum(us for _, us in by_name.values()) / steps / 1e3,
        "kernel_top": [[name, round(n / steps, 1), round(us / steps, 1)] for name, (n, us) in top],
    }


def _is_kernel(name: str) -> bool:
    """Device events that are kernels (not memcpy / memset records)."""
    lowered = name.lower()
    return not (lowered.startswith(("memcpy", "memset")) or "cudamemcpy" in lowered)


def record_decode(run: Run, engine: EngineCore, name: str, batch: int, vocab: int) -> None:
    """``decode_step_time`` at ``batch`` and its bound, into the result."""
    result = run.result
    timed = decode_step_time(run, engine, batch, vocab)
    key = str(batch)
    graphs = engine.config.model.cuda_graphs
    if not graphs and run.device.type == "cuda":  # the eager comparison: its own keys
        result["decode_step_ms_eager"][key] = round(timed["step_ms"], 4)
        result["host_phases_ms_eager"][key] = timed["phases"]
        if "kernels_per_step" in timed:
            result["kernels_per_step_eager"][key] = round(timed["kernels_per_step"], 1)
        log.info("decode batch %d (eager): %.3f ms/step, host phases %s", batch, timed["step_ms"], timed["phases"])
        return
    result["decode_step_ms"][key] = round(timed["step_ms"], 4)
    result["host_phases_ms"][key] = timed["phases"]
    result["host_step_ms"][key] = timed["phases"]["host"]
    if "kernels_per_step" in timed:
        result["kernels_per_step"][key] = round(timed["kernels_per_step"], 1)
        result["kernel_ms_per_step"][key] = round(timed["kernel_ms_per_step"], 4)
        result["kernel_top"][key] = timed["kernel_top"]
    result["decode_kv_bytes_per_step"][key] = round(timed["kv_bytes"])
    bandwidth = result.get("copy_bandwidth_gb_s")
    if bandwidth:
        bound_ms = (result["weight_bytes"][name] + timed["kv_bytes"]) / (bandwidth * 1e9) * 1e3
        result["decode_bound_ms"][key] = round(bound_ms, 5)
        result["decode_step_over_bound"][key] = round(timed["step_ms"] / bound_ms, 3)
    log.info(
        "decode batch %d: %.3f ms/step (context from %d), bound %s ms, host phases %s, kernels %s",
        batch,
        timed["step_ms"],
        timed["context_start"],
        result["decode_bound_ms"].get(key),
        timed["phases"],
        timed.get("kernels_per_step"),
    )


def copy_bandwidth(run: Run) -> float:
    """Bytes per second of a device-to-device copy (read + written), best of ``copy_reps``."""
    mib, device = run.sizes.copy_mib, run.device
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(run.sizes.copy_reps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - start
        best = min(best, seconds)
    del src, dst
    run.release_memory()
    return 2 * mib * 2**20 / best
