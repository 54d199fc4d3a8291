"""Shared scaffolding of the tensor-parallel logits tests (tests/model/test_tensor_parallel*.py):
the standard cases of the single-rank logits tests (one prompt, a chunked-prefill batch, a prefix
hit, a preemption) run on every rank of a group (``sharded_cases``: one spawn of ``size`` gloo
ranks for any number of checkpoints, kvfleet_testing/tp_ranks.py), and rank 0's rows checked
against Hugging Face (``check_ranks_against_hugging_face``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from configs import load_config
from engine.core import EngineCore
from engine.request import Request
from kvfleet_testing.tp_ranks import run_ranks
from tests.model import logits_harness as harness

TIMEOUT_S = 120


def engine_for(directory: Path, size: int, rank: int, *overrides: str) -> EngineCore:
    config = load_config("tiny", [f"model.source={directory}", f"workers.tensor_parallel_size={size}", *overrides])
    return EngineCore(config, threads=1, tensor_parallel_rank=rank)


#: the cases ``_cases`` runs, all by default
CASES = ("single", "chunked", "prefix_hit", "preempt")


def _cases(directory: Path, size: int, rank: int, cases: tuple[str, ...] = CASES) -> dict[str, dict]:
    """``cases`` on this rank: per case, per request, its tokens, prompt length and logit rows."""
    out: dict[str, dict] = {}

    def keep(case: str, requests, logits) -> None:
        out[case] = {
            rid: {"tokens": list(r.token_ids), "prompt_len": r.prompt_len, "rows": logits.get(rid, [])}
            for rid, r in requests.items()
        }

    if "single" in cases:
        engine = engine_for(directory, size, rank)
        keep("single", *harness.drive(engine, harness.random_prompts(1, (21,)), 12))
    if "chunked" in cases:
        chunking = ("scheduler.prefill_chunk_size=8", "scheduler.max_num_batched_tokens=24")
        engine = engine_for(directory, size, rank, *chunking)
        keep("chunked", *harness.drive(engine, harness.random_prompts(2, (5, 19, 40, 33)), 10))
    if "prefix_hit" in cases:
        keep("prefix_hit", *_prefix_hit(engine_for(directory, size, rank)))
    if "preempt" in cases:
        engine = engine_for(directory, size, rank)
        requests, logits = harness.drive(engine, harness.random_prompts(4, (17, 29)), 10, preempt_after=4)
        assert sum(r.num_preemptions for r in requests.values()) == 1
        keep("preempt", requests, logits)
    return out


def _prefix_hit(engine: EngineCore) -> tuple[dict[str, Request], harness.Logits]:
    """A second request sharing 36 tokens with a finished one, reusing its cached blocks."""
    shared = harness.random_prompts(3, (36,))[0]
    harness.drive(engine, [[*shared, 7, 8, 9]], max_tokens=4)
    engine.scheduler.requests.clear()
    requests, logits = harness.drive(engine, [[*shared, 10, 11]], max_tokens=8)
    assert requests["r0"].num_cached_tokens >= 32
    return requests, logits


def _every_model(models: dict[str, tuple[str, tuple[str, ...]]], rank: int, size: int) -> dict[str, dict[str, dict]]:
    """``_cases`` of each checkpoint, in one group of ranks (one spawn for them all)."""
    return {name: _cases(Path(directory), size, rank, cases) for name, (directory, cases) in models.items()}


def sharded_cases(
    directories: dict[str, Path], size: int, cases: dict[str, tuple[str, ...]] | None = None
) -> list[dict[str, dict[str, dict]]]:
    """Per rank, per checkpoint, its ``cases`` (default all, ``CASES``) run by ``size`` ranks
    joined over gloo."""
    models = {name: (str(directory), (cases or {}).get(name, CASES)) for name, directory in directories.items()}
    return run_ranks(functools.partial(_every_model, models), size, TIMEOUT_S)


def check_ranks_against_hugging_face(directory: Path, ranks: list[dict[str, dict]]) -> int:
    """Every sampled row of rank 0 within ``harness.ATOL`` of HF's fp32 forward, every rank's tokens
    the same; returns how many rows were compared."""
    hf = harness.hf_model(directory)
    compared = 0
    for case, requests in ranks[0].items():
        for rid, request in requests.items():
            with torch.no_grad():
                reference = hf(torch.tensor([request["tokens"]])).logits[0]
            assert len(request["rows"]) == len(request["tokens"]) - request["prompt_len"]
            for k, row in enumerate(request["rows"]):
                diff = (row - reference[request["prompt_len"] - 1 + k]).abs().max().item()
                assert diff < harness.ATOL, f"{case} {rid} output {k}: max |diff| {diff:.2e}"
                compared += 1
            for other in ranks[1:]:  # every rank computed the same tokens
                assert other[case][rid]["tokens"] == request["tokens"], f"{case} {rid}"
    return compared
