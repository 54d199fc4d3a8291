"""Shared scaffolding of the logits-vs-Hugging-Face tests (tests/model/test_logits_*.py).

Owns: building an engine over a tiny checkpoint directory, driving it step by step through the
real scheduler, coordinator and runner while keeping every sampled row of logits, the fp32 HF
reference forward, and the standard cases (single prompt, chunked-prefill batch, prefix hit,
preempt and resume, bf16 closeness) that each model family's test file runs on its checkpoints.
Invariant: every comparison is against one full HF forward over a request's final sequence; TF32
is disabled at import so CUDA matmuls stay fp32.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from configs import load_config
from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams

ATOL = 1e-4  # fp32, on CPU and on CUDA (TF32 disabled below)
BF16_ATOL = 0.1  # bf16 weights and activations vs HF in fp32: logits here are O(1-5)
BF16_VS_HF = 1.25  # ... or at most this times HF's own bf16 distance from its fp32 logits
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

Logits = dict[str, list[torch.Tensor]]


def random_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Prompts of the given lengths with token ids in [3, 256), drawn from ``Random(seed)``."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def make_engine(directory: Path, *overrides: str, device: str = "cpu") -> EngineCore:
    """A single-threaded engine over the checkpoint in ``directory`` (the ``tiny`` config)."""
    config = load_config("tiny", [f"model.source={directory}", f"model.device={device}", *overrides])
    return EngineCore(config, threads=1)


def drive(
    engine: EngineCore, prompts: list[list[int]], max_tokens: int, preempt_after: int | None = None
) -> tuple[dict[str, Request], Logits]:
    """Run to completion; returns per request the request and the logits of each step."""
    logits: Logits = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    requests = dict(engine.scheduler.requests)
    steps = 0
    while engine.has_work:
        output = engine.scheduler.schedule()
        sampled, rows = engine.runner.logits_for(output)
        for rid, row in rows.items():
            logits.setdefault(rid, []).append(row)
        engine.scheduler.update(output, sampled)
        engine.coordinator.check_invariants()
        steps += 1
        if preempt_after is not None and steps == preempt_after and engine.scheduler.running:
            victim = engine.scheduler.running.pop()
            engine.scheduler._preempt(victim)
            # Dropping its logits since the last admission keeps positions aligned below.
        assert steps < 500
    return requests, logits


def hf_model(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """HF transformers' model for the checkpoint, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def check_against_hf(directory: Path, requests: dict[str, Request], logits: Logits) -> None:
    """Every sampled position's logits within ``ATOL`` of HF's fp32 forward."""
    hf = hf_model(directory)
    for rid, request in requests.items():
        tokens = torch.tensor([request.token_ids])
        with torch.no_grad():
            reference = hf(tokens).logits[0]
        rows = logits[rid]
        assert len(rows) == request.num_output_tokens
        for k, row in enumerate(rows):
            position = request.prompt_len - 1 + k
            diff = (row - reference[position]).abs().max().item()
            assert diff < ATOL, f"{rid} output {k}: max |diff| {diff:.2e}"


def run_and_check(
    directory: Path,
    device: str,
    prompts: list[list[int]],
    max_tokens: int,
    *overrides: str,
    preempt_after: int | None = None,
) -> dict[str, Request]:
    """Drive a fresh engine (config ``overrides``) over ``prompts`` and check it against HF."""
    engine = make_engine(directory, *overrides, device=device)
    requests, logits = drive(engine, prompts, max_tokens, preempt_after=preempt_after)
    check_against_hf(directory, requests, logits)
    return requests


def check_single_prompt(directory: Path, device: str) -> None:
    run_and_check(directory, device, random_prompts(1, (21,)), 12)


def check_chunked_batch(
    directory: Path,
    device: str,
    lengths: tuple[int, ...] = (5, 19, 40, 33),
    chunk: int = 8,
    budget: int = 24,
) -> None:
    """A batch of different lengths, prefilled in chunks of ``chunk`` tokens."""
    overrides = (f"scheduler.prefill_chunk_size={chunk}", f"scheduler.max_num_batched_tokens={budget}")
    run_and_check(directory, device, random_prompts(2, lengths), 10, *overrides)


def check_prefix_hit(directory: Path, device: str) -> None:
    """A second request sharing 36 tokens with a finished one reuses its cached blocks."""
    engine = make_engine(directory, device=device)
    shared = random_prompts(3, (36,))[0]
    drive(engine, [[*shared, 7, 8, 9]], max_tokens=4)
    engine.scheduler.requests.clear()
    requests, logits = drive(engine, [[*shared, 10, 11]], max_tokens=8)
    assert requests["r0"].num_cached_tokens >= 32  # a real prefix hit: the state came from a block
    check_against_hf(directory, requests, logits)


def check_preempt_and_resume(directory: Path, device: str) -> None:
    requests = run_and_check(directory, device, random_prompts(4, (17, 29)), 10, preempt_after=4)
    assert sum(r.num_preemptions for r in requests.values()) == 1


def check_bfloat16_close(directory: Path, device: str) -> None:
    """bf16 logits as close to HF's fp32 ones as bf16 allows: within ``BF16_ATOL``, or within
    ``BF16_VS_HF`` times the distance of HF's own bf16 forward at that position (some checkpoints'
    bf16 rounding alone moves a logit further: tiny-gpt-oss's HF bf16 forward is 0.199 from its
    fp32 one on an H200)."""
    engine = make_engine(directory, "model.dtype=bfloat16", device=device)
    requests, logits = drive(engine, random_prompts(5, (9, 26)), max_tokens=6)
    hf, hf_bf16 = hf_model(directory), hf_model(directory, torch.bfloat16)
    for rid, request in requests.items():
        with torch.no_grad():
            ids = torch.tensor([request.token_ids])
            reference, rounded = hf(ids).logits[0], hf_bf16(ids).logits[0].float()
        for k, row in enumerate(logits[rid]):
            position = request.prompt_len - 1 + k
            diff = (row.float() - reference[position]).abs().max().item()
            hf_diff = (rounded[position] - reference[position]).abs().max().item()
            assert diff < max(BF16_ATOL, BF16_VS_HF * hf_diff), (
                f"{rid} output {k}: max |diff| {diff:.3f} (HF's bf16 forward: {hf_diff:.3f})"
            )
