"""A worker's tensor-parallel ranks led by rank 0 (engine/rank_group.py): only rank 0 schedules;
each step's inputs (and the host tier's copies) go to the other ranks, which run the same forward
on their shards. Against oracles: rank 0's logits equal Hugging Face's (fp32, atol 1e-4) over the
single-rank cases (one prompt, a chunked-prefill batch, a prefix hit, a preemption), and greedy
tokens through ``EngineCore.step`` with a host tier (a prefix offloaded, then promoted) equal a
single-rank engine's. Two processes over gloo on loopback.
"""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from configs import load_config
from engine.core import EngineCore
from engine.model.checkpoints.tiny import build_tiny_checkpoint
from engine.rank_group import follow_leader, lead_ranks
from kvfleet_testing.ports import free_port
from tests.engine.test_host_tier import TIERED, generate, workload
from tests.model import logits_harness as harness

SIZE = 2
TIMEOUT_S = 120


def _engine(directory: Path, rank: int, *overrides: str, preset: str = "tiny") -> EngineCore:
    config = load_config(preset, [f"model.source={directory}", f"workers.tensor_parallel_size={SIZE}", *overrides])
    return EngineCore(config, threads=1, tensor_parallel_rank=rank)


def _led(directory: Path, rank: int, run, *overrides: str, preset: str = "tiny"):
    """Build this rank's engine; rank 0 leads ``run(engine)``, the others follow it."""
    engine = _engine(directory, rank, *overrides, preset=preset)
    if rank:
        follow_leader(engine.runner)
        return None
    leader = lead_ranks(engine.runner)
    try:
        return run(engine)
    finally:
        leader.stop()


def _cases(directory: Path, hybrid: Path, rank: int) -> dict[str, object]:
    out: dict[str, object] = {}

    def keep(case: str, found) -> None:
        if found is not None:
            requests, logits = found
            out[case] = {
                rid: {"tokens": list(r.token_ids), "prompt_len": r.prompt_len, "rows": logits.get(rid, [])}
                for rid, r in requests.items()
            }

    keep("single", _led(directory, rank, lambda e: harness.drive(e, harness.random_prompts(1, (21,)), 12)))
    chunked = ("scheduler.prefill_chunk_size=8", "scheduler.max_num_batched_tokens=24")
    prompts = harness.random_prompts(2, (5, 19, 40, 33))
    keep("chunked", _led(directory, rank, lambda e: harness.drive(e, prompts, 10), *chunked))

    def prefix_hit(engine: EngineCore):
        shared = harness.random_prompts(3, (36,))[0]
        harness.drive(engine, [[*shared, 7, 8, 9]], max_tokens=4)
        engine.scheduler.requests.clear()
        found = harness.drive(engine, [[*shared, 10, 11]], max_tokens=8)
        assert found[0]["r0"].num_cached_tokens >= 32
        return found

    keep("prefix_hit", _led(directory, rank, prefix_hit))
    keep("preempt", _led(directory, rank, lambda e: harness.drive(e, harness.random_prompts(4, (17, 29)), 10, 4)))

    def tiered(engine: EngineCore) -> dict[str, object]:
        a, b, flood = workload()
        tokens = {"a": generate(engine, "a", a)[0]}
        for i, prompt in enumerate(flood):
            tokens[f"flood{i}"] = generate(engine, f"flood{i}", prompt)[0]
        tokens["b"], cached = generate(engine, "b", b)
        host = engine.coordinator.host
        assert host is not None
        return {"tokens": tokens, "cached": cached, "promoted": host.counters.promoted}

    found = _led(directory, rank, tiered, *TIERED)
    if found is not None:
        out["tiered"] = found
    found = _led(hybrid, rank, tiered, *TIERED, preset="tiny-hybrid")  # Mamba2 states split by heads
    if found is not None:
        out["tiered_hybrid"] = found
    return out


def _rank_main(rank: int, port: int, directory: str, hybrid: str, result: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=SIZE,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        torch.save(_cases(Path(directory), Path(hybrid), rank), f"{result}.{rank}")
    except BaseException:
        Path(f"{result}.{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def led(tmp_path_factory) -> tuple[Path, Path, dict[str, object]]:
    """Rank 0's cases from two processes, rank 0 leading, and the checkpoints they ran."""
    root = tmp_path_factory.mktemp("ranks")
    directory = build_tiny_checkpoint("tiny-gemma3", root / "ckpt", seed=3)
    hybrid = build_tiny_checkpoint("tiny-bamba", root / "hybrid", seed=3)
    result = root / "out"
    ctx = mp.get_context("spawn")
    port = free_port()
    args = (port, str(directory), str(hybrid), str(result))
    procs = [ctx.Process(target=_rank_main, args=(r, *args), daemon=True) for r in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(TIMEOUT_S * 3)
    errors = [p.read_text() for p in root.glob("out.*.error")]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert not errors, errors[0]
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    follower = torch.load(f"{result}.1")
    assert follower == {}, "a follower keeps no result of its own"
    return directory, hybrid, torch.load(f"{result}.0")


def test_rank_zero_leads_and_its_logits_equal_hugging_face(led) -> None:
    directory, _, cases = led
    hf = harness.hf_model(directory)
    compared = 0
    for case in ("single", "chunked", "prefix_hit", "preempt"):
        for rid, request in cases[case].items():
            with torch.no_grad():
                reference = hf(torch.tensor([request["tokens"]])).logits[0]
            assert len(request["rows"]) == len(request["tokens"]) - request["prompt_len"]
            for k, row in enumerate(request["rows"]):
                diff = (row - reference[request["prompt_len"] - 1 + k]).abs().max().item()
                assert diff < harness.ATOL, f"{case} {rid} output {k}: max |diff| {diff:.2e}"
                compared += 1
    assert compared > 50


@pytest.mark.parametrize(("case", "preset"), [("tiered", "tiny"), ("tiered_hybrid", "tiny-hybrid")])
def test_led_ranks_generate_the_single_rank_tokens_through_the_host_tier(case: str, preset: str, led) -> None:
    directory, hybrid, cases = led
    tiered = cases[case]
    source = directory if case == "tiered" else hybrid
    engine = EngineCore(load_config(preset, [f"model.source={source}", *TIERED]), threads=1)
    a, b, flood = workload()
    expected = {"a": generate(engine, "a", a)[0]}
    for i, prompt in enumerate(flood):
        expected[f"flood{i}"] = generate(engine, f"flood{i}", prompt)[0]
    expected["b"], cached = generate(engine, "b", b)
    assert tiered["tokens"] == expected
    assert tiered["cached"] == cached > 0 and tiered["promoted"] > 0, "the prefix came back from the host tier"
