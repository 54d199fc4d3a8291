"""kvfleet's logits equal Hugging Face transformers' on the same tiny random checkpoints (fp32).

Each case drives the real scheduler, coordinator and runner and compares every sampled
position's logits with one full HF forward over the final sequence (atol 1e-4); the cases live in
tests/model/logits_harness.py, shared with the other model families' logits tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.checkpoints.tiny import TINY, build_tiny_checkpoint
from tests.model import logits_harness as harness

ARCHS = sorted(TINY)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny_checkpoint(name, root / name, seed=3) for name in ARCHS}


@pytest.mark.parametrize("name", ARCHS)
def test_single_prompt(name: str, checkpoints, device: str) -> None:
    harness.check_single_prompt(checkpoints[name], device)


@pytest.mark.parametrize("name", ARCHS)
def test_batch_of_different_lengths_with_chunked_prefill(name: str, checkpoints, device: str) -> None:
    # Chunks of 8 tokens; prompts cross the 16-token sliding window and the Mamba chunk (16).
    harness.check_chunked_batch(checkpoints[name], device)


@pytest.mark.parametrize("name", ARCHS)
def test_second_request_hits_the_first_ones_prefix(name: str, checkpoints, device: str) -> None:
    harness.check_prefix_hit(checkpoints[name], device)


@pytest.mark.parametrize("name", ARCHS)
def test_preempted_and_resumed_request(name: str, checkpoints, device: str) -> None:
    harness.check_preempt_and_resume(checkpoints[name], device)


@pytest.mark.parametrize("name", ARCHS)
def test_bfloat16_stays_close_to_fp32_reference(name: str, checkpoints, device: str) -> None:
    harness.check_bfloat16_close(checkpoints[name], device)
