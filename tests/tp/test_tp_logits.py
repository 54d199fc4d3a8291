"""Logits of a tensor-parallel engine equal Hugging Face's (fp32, atol 1e-4: the single-rank bar
of tests/model/logits_harness.py) with every rank a process of a gloo group on 127.0.0.1.

Each rank runs its own engine over its shard (engine/model/sharding.py) through the same steps;
rank 0 compares every sampled row of logits with the full HF forward, the other ranks check that
their rows equal rank 0's (the logits are replicated, not gathered)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.model.checkpoints.tiny import build_tiny_checkpoint
from engine.rank_group import spawn_ranks
from tests.model import logits_harness as harness


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-tp")
    return {name: build_tiny_checkpoint(name, root / name, seed=3) for name in ("tiny-gemma3", "tiny-llama")}


def _case(rank: int, size: int, directory: str, case: str) -> None:
    overrides = ("scheduler.prefill_chunk_size=8", "scheduler.max_num_batched_tokens=24")
    engine = harness.make_engine(Path(directory), *overrides)
    assert engine.info.arch.num_heads * size == 4  # the rank's share of the tiny models' 4 heads
    if case == "prefix":
        shared = harness.random_prompts(3, (36,))[0]
        harness.drive(engine, [[*shared, 7, 8, 9]], max_tokens=4)
        engine.scheduler.requests.clear()
        requests, logits = harness.drive(engine, [[*shared, 10, 11]], max_tokens=6)
        assert requests["r0"].num_cached_tokens >= 32  # a real prefix hit
    else:
        prompts = harness.random_prompts(2, (5, 19, 40, 33) if case == "batch" else (17, 29))
        requests, logits = harness.drive(engine, prompts, 8, preempt_after=4 if case == "preempt" else None)
        if case == "preempt":
            assert sum(r.num_preemptions for r in requests.values()) == 1
    rows = torch.cat([torch.stack(logits[rid]) for rid in sorted(logits)])
    first = rows.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(rows, first), f"rank {rank}'s logits differ from rank 0's"
    if rank == 0:
        harness.check_against_hf(Path(directory), requests, logits)


def _cases(rank: int, size: int, directory: str, cases: tuple[str, ...]) -> None:
    """Each case on a fresh engine, in one group (spawning ranks costs more than the cases)."""
    torch.set_num_threads(1)
    for case in cases:
        _case(rank, size, directory, case)


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-llama"])
def test_two_ranks_match_hf_batched_chunked_prefix_hit_and_preempted(name: str, checkpoints) -> None:
    spawn_ranks(_cases, 2, str(checkpoints[name]), ("batch", "prefix", "preempt"), timeout_s=60.0)


def test_four_ranks_match_hf_with_replicated_kv_heads(checkpoints) -> None:
    spawn_ranks(_cases, 4, str(checkpoints["tiny-gemma3"]), ("batch",), timeout_s=60.0)
