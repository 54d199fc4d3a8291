"""kvfleet's logits equal Hugging Face transformers' on the same tiny random checkpoints (fp32).

Each case drives the real scheduler, coordinator and runner and compares every sampled
position's logits with one full HF forward over the final sequence (atol 1e-4).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from configs import load_config
from engine.core import EngineCore
from engine.model.tiny import TINY, build_tiny_checkpoint
from engine.sampling_params import SamplingParams

ATOL = 1e-4  # fp32, on CPU and on CUDA (TF32 disabled below)
ARCHS = sorted(TINY)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny_checkpoint(name, root / name, seed=3) for name in ARCHS}


def _engine(directory: Path, *overrides: str, device: str = "cpu") -> EngineCore:
    config = load_config("tiny", [f"model.source={directory}", f"model.device={device}", *overrides])
    return EngineCore(config, threads=1)


def _drive(engine: EngineCore, prompts: list[list[int]], max_tokens: int, preempt_after: int | None = None):
    """Run to completion; returns per request the generated tokens and the logits of each step."""
    logits: dict[str, list[torch.Tensor]] = {}
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


def _check_against_hf(directory: Path, requests, logits) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
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


@pytest.mark.parametrize("name", ARCHS)
def test_single_prompt(name: str, checkpoints, device: str) -> None:
    engine = _engine(checkpoints[name], device=device)
    rng = random.Random(1)
    requests, logits = _drive(engine, [[rng.randrange(3, 256) for _ in range(21)]], max_tokens=12)
    _check_against_hf(checkpoints[name], requests, logits)


@pytest.mark.parametrize("name", ARCHS)
def test_batch_of_different_lengths_with_chunked_prefill(name: str, checkpoints, device: str) -> None:
    # Chunks of 8 tokens; prompts cross the 16-token sliding window and the Mamba chunk (16).
    engine = _engine(
        checkpoints[name], "scheduler.prefill_chunk_size=8", "scheduler.max_num_batched_tokens=24", device=device
    )
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 19, 40, 33)]
    requests, logits = _drive(engine, prompts, max_tokens=10)
    _check_against_hf(checkpoints[name], requests, logits)


@pytest.mark.parametrize("name", ARCHS)
def test_second_request_hits_the_first_ones_prefix(name: str, checkpoints, device: str) -> None:
    engine = _engine(checkpoints[name], device=device)
    rng = random.Random(3)
    shared = [rng.randrange(3, 256) for _ in range(36)]
    first, first_logits = _drive(engine, [shared + [7, 8, 9]], max_tokens=4)
    engine.scheduler.requests.clear()
    engine.add_request("second", shared + [10, 11], SamplingParams(max_tokens=8, ignore_eos=True))
    second = {"second": engine.scheduler.requests["second"]}
    logits: dict[str, list[torch.Tensor]] = {}
    while engine.has_work:
        output = engine.scheduler.schedule()
        sampled, rows = engine.runner.logits_for(output)
        for rid, row in rows.items():
            logits.setdefault(rid, []).append(row)
        engine.scheduler.update(output, sampled)
    assert second["second"].num_cached_tokens >= 32  # a real prefix hit happened
    _check_against_hf(checkpoints[name], second, logits)


@pytest.mark.parametrize("name", ARCHS)
def test_preempted_and_resumed_request(name: str, checkpoints, device: str) -> None:
    engine = _engine(checkpoints[name], device=device)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (17, 29)]
    requests, logits = _drive(engine, prompts, max_tokens=10, preempt_after=4)
    assert sum(r.num_preemptions for r in requests.values()) == 1
    _check_against_hf(checkpoints[name], requests, logits)


BF16_ATOL = 0.1  # bf16 weights and activations vs HF in fp32: logits here are O(1-5)


@pytest.mark.parametrize("name", ARCHS)
def test_bfloat16_stays_close_to_fp32_reference(name: str, checkpoints, device: str) -> None:
    engine = _engine(checkpoints[name], "model.dtype=bfloat16", device=device)
    rng = random.Random(5)
    requests, logits = _drive(engine, [[rng.randrange(3, 256) for _ in range(n)] for n in (9, 26)], max_tokens=6)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32).eval()
    for rid, request in requests.items():
        with torch.no_grad():
            reference = hf(torch.tensor([request.token_ids])).logits[0]
        for k, row in enumerate(logits[rid]):
            diff = (row.float() - reference[request.prompt_len - 1 + k]).abs().max().item()
            assert diff < BF16_ATOL, f"{rid} output {k}: max |diff| {diff:.3f}"
