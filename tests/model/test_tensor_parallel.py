"""Tensor parallelism (engine/model/layers/parallel.py): logits of a worker split over 2 and 4 ranks
equal Hugging Face's (fp32, atol 1e-4, the single-rank bar), through the real scheduler,
coordinator and runner on every rank, over gloo on loopback; and the sizes a model cannot be split
by are refused naming the field, the model and the number.

Each rank is a process with its own ``EngineCore(tensor_parallel_rank=r)`` driven with the same
requests; only the model's forward talks to the other ranks (the attention and MLP sums). The
cases are those of the single-rank logits tests: one prompt, a chunked-prefill batch, a prefix
hit, a preemption.
"""

from __future__ import annotations

import dataclasses
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
from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.checkpoints.loader import read_hf_config
from engine.model.checkpoints.tiny import build_tiny_checkpoint
from engine.model.layers.parallel import TensorParallelError, check_tensor_parallel, shard_arch
from kvfleet_testing.ports import free_port
from tests.model import logits_harness as harness

TIMEOUT_S = 120


def _engine(directory: Path, size: int, rank: int, *overrides: str) -> EngineCore:
    config = load_config("tiny", [f"model.source={directory}", f"workers.tensor_parallel_size={size}", *overrides])
    return EngineCore(config, threads=1, tensor_parallel_rank=rank)


def _cases(directory: Path, size: int, rank: int) -> dict[str, dict]:
    """Every case on this rank: per case, per request, its tokens, prompt length and logit rows."""
    out: dict[str, dict] = {}

    def keep(case: str, requests, logits) -> None:
        out[case] = {
            rid: {"tokens": list(r.token_ids), "prompt_len": r.prompt_len, "rows": logits.get(rid, [])}
            for rid, r in requests.items()
        }

    engine = _engine(directory, size, rank)
    keep("single", *harness.drive(engine, harness.random_prompts(1, (21,)), 12))
    engine = _engine(directory, size, rank, "scheduler.prefill_chunk_size=8", "scheduler.max_num_batched_tokens=24")
    keep("chunked", *harness.drive(engine, harness.random_prompts(2, (5, 19, 40, 33)), 10))
    engine = _engine(directory, size, rank)
    shared = harness.random_prompts(3, (36,))[0]
    harness.drive(engine, [[*shared, 7, 8, 9]], max_tokens=4)
    engine.scheduler.requests.clear()
    requests, logits = harness.drive(engine, [[*shared, 10, 11]], max_tokens=8)
    assert requests["r0"].num_cached_tokens >= 32
    keep("prefix_hit", requests, logits)
    engine = _engine(directory, size, rank)
    requests, logits = harness.drive(engine, harness.random_prompts(4, (17, 29)), 10, preempt_after=4)
    assert sum(r.num_preemptions for r in requests.values()) == 1
    keep("preempt", requests, logits)
    return out


def _rank_main(rank: int, size: int, port: int, directory: str, result: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        cases = _cases(Path(directory), size, rank)
        torch.save(cases, f"{result}.{rank}")
    except BaseException:
        Path(f"{result}.{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(directory: Path, size: int, tmp: Path) -> list[dict[str, dict]]:
    """Every rank's cases, from ``size`` processes joined over gloo."""
    result = tmp / f"tp{size}"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, port, str(directory), str(result)), daemon=True)
        for r in range(size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(TIMEOUT_S * 3)
    errors = [p.read_text() for p in tmp.glob(f"tp{size}.*.error")]
    alive = [p.pid for p in procs if p.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert not errors, errors[0]
    assert not alive, f"ranks {alive} did not finish in time"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(f"{result}.{r}") for r in range(size)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {
        name: build_tiny_checkpoint(name, root / name, seed=3) for name in ("tiny-gemma3", "tiny-llama", "tiny-qwen2")
    }


@pytest.mark.parametrize(
    ("name", "size"), [("tiny-gemma3", 2), ("tiny-llama", 2), ("tiny-qwen2", 2), ("tiny-gemma3", 4)]
)
def test_logits_split_over_ranks_equal_hugging_face(name: str, size: int, checkpoints, tmp_path: Path) -> None:
    directory = checkpoints[name]
    ranks = run_ranks(directory, size, tmp_path)
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
    assert compared > 50


def _arch(directory: Path):
    return arch_from_hf_config(read_hf_config(directory))


def test_rank_local_shapes(checkpoints) -> None:
    arch = _arch(checkpoints["tiny-gemma3"])  # 4 query / 2 KV heads
    two, four = shard_arch(arch, 2, 1), shard_arch(arch, 4, 3)
    assert (two.num_heads, two.num_kv_heads, two.intermediate_size) == (2, 1, arch.intermediate_size // 2)
    assert (four.num_heads, four.num_kv_heads) == (1, 1)  # each KV head on two ranks
    assert (four.tp_size, four.tp_rank) == (4, 3)
    assert shard_arch(arch, 1, 0) is arch


@pytest.mark.parametrize(
    ("change", "size", "words"),
    [
        ({}, 3, "must divide tiny-gemma3's 4 attention heads (got 3)"),
        ({"num_heads": 8, "num_kv_heads": 3}, 2, "3 KV heads"),
        ({"intermediate_size": 130}, 4, "MLP width 130 (got 4)"),
        ({"family": "bamba"}, 2, "recurrent layers are not sharded"),
    ],
)
def test_sizes_the_model_cannot_split_by_are_refused(change: dict, size: int, words: str, checkpoints) -> None:
    arch = dataclasses.replace(_arch(checkpoints["tiny-gemma3"]), architecture="tiny-gemma3", **change)
    with pytest.raises(TensorParallelError, match=r"workers\.tensor_parallel_size") as info:
        check_tensor_parallel(arch, size)
    assert words in str(info.value)


def test_a_bad_size_is_refused_before_the_engine_loads(checkpoints) -> None:
    with pytest.raises(TensorParallelError, match=r"workers\.tensor_parallel_size: must divide .* \(got 3\)"):
        _engine(checkpoints["tiny-qwen2"], 3, 0)


def test_the_cluster_refuses_split_workers_it_cannot_start_before_starting_any(checkpoints) -> None:
    from cluster.placement import PlacementError
    from cluster.placement import check_tensor_parallel as check_cluster

    directory = checkpoints["tiny-qwen2"]
    check_cluster(load_config("tiny", [f"model.source={directory}"]), directory)  # TP=1: nothing to refuse
    with pytest.raises(TensorParallelError, match=r"must divide .* \(got 3\)"):
        check_cluster(load_config("tiny", [f"model.source={directory}", "workers.tensor_parallel_size=3"]), directory)
    split = [f"model.source={directory}", "workers.tensor_parallel_size=2"]
    with pytest.raises(PlacementError, match=r"workers\.tensor_parallel_size: prefill / decode .* \(got 2\)"):
        check_cluster(load_config("tiny", [*split, "workers.num_prefill=1"]), directory)
    check_cluster(load_config("tiny", [*split, "workers.num_prefill=0"]), directory)  # aggregated: it starts


def test_more_ranks_than_the_largest_node_has_devices_are_refused(checkpoints) -> None:
    from cluster.placement import PlacementError, largest_node_devices
    from cluster.placement import check_tensor_parallel as check_cluster

    nodes = [
        {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
        {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 4.0}},
        {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},
    ]
    assert largest_node_devices(nodes, "cuda") == 4 and largest_node_devices(nodes, "cpu") == 8
    directory = checkpoints["tiny-gemma3"]
    config = load_config("tiny", [f"model.source={directory}", "workers.tensor_parallel_size=4"])
    with pytest.raises(PlacementError, match=r"workers\.tensor_parallel_size: .* has 2 CPUs \(got 4\)"):
        check_cluster(config, directory, [{"Alive": True, "Resources": {"CPU": 2.0}}])
    aggregated = load_config(
        "tiny", [f"model.source={directory}", "workers.tensor_parallel_size=4", "workers.num_prefill=0"]
    )
    check_cluster(aggregated, directory, nodes)  # fits the 8-CPU node
