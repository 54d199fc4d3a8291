"""Tensor parallelism (engine/model/layers/parallel.py): logits of a worker split over 2 ranks,
and over 4 for an attention and a Mamba2 family, equal Hugging Face's (fp32, atol 1e-4, the
single-rank bar), through the real scheduler, coordinator and runner on every rank, over gloo on
loopback; and the sizes a model cannot be split by are refused naming the field, the model and
the number.

Each rank is a process with its own ``EngineCore(tensor_parallel_rank=r)`` driven with the same
requests; only the model's forward talks to the other ranks (the attention and MLP sums). The
cases are those of the single-rank logits tests: one prompt, a chunked-prefill batch, a prefix
hit, a preemption.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from configs import load_config
from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.checkpoints.loader import read_hf_config
from engine.model.checkpoints.tiny import build_tiny_checkpoint
from engine.model.layers.parallel import TensorParallelError, check_tensor_parallel, shard_arch
from tests.model.tp_harness import check_ranks_against_hugging_face, engine_for, sharded_cases


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {
        name: build_tiny_checkpoint(name, root / name, seed=3) for name in ("tiny-gemma3", "tiny-llama", "tiny-qwen2")
    }


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-llama", "tiny-qwen2"])
def test_logits_split_over_two_ranks_equal_hugging_face(name: str, checkpoints) -> None:
    directory = checkpoints[name]
    ranks = sharded_cases({name: directory}, 2)
    assert check_ranks_against_hugging_face(directory, [rank[name] for rank in ranks]) > 50


def test_logits_split_over_four_ranks_equal_hugging_face_for_attention_and_mamba2(
    checkpoints, tmp_path_factory
) -> None:
    """TP=4 on an attention family (Gemma 3: its 2 KV heads each on two ranks) and a Mamba2 hybrid
    (Bamba: 8 Mamba2 heads, 2 a rank; its one group shared by all four), in one group of ranks."""
    directories = {
        "tiny-gemma3": checkpoints["tiny-gemma3"],
        "tiny-bamba": build_tiny_checkpoint("tiny-bamba", tmp_path_factory.mktemp("tp4") / "tiny-bamba", seed=3),
    }
    ranks = sharded_cases(directories, 4)
    for name, directory in directories.items():
        assert check_ranks_against_hugging_face(directory, [rank[name] for rank in ranks]) > 50, name


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
    ],
)
def test_sizes_the_model_cannot_split_by_are_refused(change: dict, size: int, words: str, checkpoints) -> None:
    arch = dataclasses.replace(_arch(checkpoints["tiny-gemma3"]), architecture="tiny-gemma3", **change)
    with pytest.raises(TensorParallelError, match=r"workers\.tensor_parallel_size") as info:
        check_tensor_parallel(arch, size)
    assert words in str(info.value)


def test_a_bad_size_is_refused_before_the_engine_loads(checkpoints) -> None:
    with pytest.raises(TensorParallelError, match=r"workers\.tensor_parallel_size: must divide .* \(got 3\)"):
        engine_for(checkpoints["tiny-qwen2"], 3, 0)


def test_the_cluster_refuses_split_workers_it_cannot_start_before_starting_any(checkpoints) -> None:
    from cluster.placement import check_tensor_parallel as check_cluster

    directory = checkpoints["tiny-qwen2"]
    check_cluster(load_config("tiny", [f"model.source={directory}"]), directory)  # TP=1: nothing to refuse
    with pytest.raises(TensorParallelError, match=r"must divide .* \(got 3\)"):
        check_cluster(load_config("tiny", [f"model.source={directory}", "workers.tensor_parallel_size=3"]), directory)
    split = [f"model.source={directory}", "workers.tensor_parallel_size=2"]
    check_cluster(load_config("tiny", [*split, "workers.num_prefill=1"]), directory)  # P/D: ranks read ranks
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
