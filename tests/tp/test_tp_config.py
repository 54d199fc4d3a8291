"""``workers.tensor_parallel_size``: the schema fields and the checks made against the model and
the node before any worker starts (engine/model/tensor_parallel.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from configs.load import load_config
from engine.core import resolve_model_directory
from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.arch.model_arch import MambaArch, ModelArch
from engine.model.checkpoints.loader import read_hf_config
from engine.model.tensor_parallel import (
    TensorParallelError,
    check_tensor_parallel,
    check_tensor_parallel_at_edge,
    largest_node_devices,
    shard_problems,
)

TINY_SOURCES = ("tiny-gemma3", "tiny-bamba", "tiny-qwen3-next", "tiny-granite-h", "tiny-nemotron-h")


def _arch(source: str) -> ModelArch:
    config = load_config("tiny", [f"model.source={source}"])
    return arch_from_hf_config(read_hf_config(resolve_model_directory(config)))


def test_schema_default_and_role_overrides():
    workers = load_config("tiny").workers
    assert workers.tensor_parallel_size == 1
    assert workers.tensor_parallel("prefill") == ("workers.tensor_parallel_size", 1)
    workers = load_config("tiny", ["workers.tensor_parallel_size=2", "workers.decode_tensor_parallel_size=4"]).workers
    assert workers.tensor_parallel("prefill") == ("workers.tensor_parallel_size", 2)
    assert workers.tensor_parallel("decode") == ("workers.decode_tensor_parallel_size", 4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        load_config("tiny", ["workers.tensor_parallel_size=0"])


@pytest.mark.parametrize("source", TINY_SOURCES)
def test_every_tiny_family_shards_two_ways_and_not_three(source):
    arch = _arch(source)
    assert shard_problems(arch, 1) == []
    assert shard_problems(arch, 2) == []
    with pytest.raises(TensorParallelError) as raised:
        check_tensor_parallel(arch, 3, field="workers.tensor_parallel_size", model=source)
    message = str(raised.value)
    assert "workers.tensor_parallel_size=3" in message and source in message and "not divisible by 3" in message


def test_four_ranks_replicate_key_value_heads_and_the_single_mamba_group():
    gemma, bamba = _arch("tiny-gemma3"), _arch("tiny-bamba")
    assert gemma.num_kv_heads == 2 and shard_problems(gemma, 4) == []
    assert bamba.mamba is not None and bamba.mamba.n_groups == 1 and shard_problems(bamba, 4) == []
    assert any("attention heads = 4" in p for p in shard_problems(gemma, 8))


def test_each_width_is_checked():
    gemma = _arch("tiny-gemma3")
    assert shard_problems(replace(gemma, num_kv_heads=3, num_heads=6), 2) == ["key/value heads = 3, not divisible by 2"]
    assert shard_problems(replace(gemma, intermediate_size=130), 4) == [
        "MLP intermediate size = 130, not divisible by 4"
    ]
    bamba = _arch("tiny-bamba")
    assert bamba.mamba is not None
    odd_mamba: MambaArch = replace(bamba.mamba, num_heads=6, n_groups=3)
    assert shard_problems(replace(bamba, mamba=odd_mamba), 4) == [
        "Mamba2 heads = 6, not divisible by 4",
        "Mamba2 groups = 3, not divisible by 4 (only a single group is replicated)",
    ]
    nemotron = _arch("tiny-nemotron-h")
    assert nemotron.moe is not None
    assert "expert intermediate size = 30, not divisible by 4" in shard_problems(
        replace(nemotron, moe=replace(nemotron.moe, intermediate_size=30)), 4
    )
    qwen3_next = _arch("tiny-qwen3-next")
    assert qwen3_next.gated_deltanet is not None
    assert shard_problems(qwen3_next, 4) == ["Gated DeltaNet key heads = 2, not divisible by 4"]


def test_more_ranks_than_the_largest_node_has_devices_is_refused():
    nodes: list[dict[str, object]] = [
        {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
        {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 4.0}},
        {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},
    ]
    assert largest_node_devices(nodes, "cuda") == 4 and largest_node_devices(nodes, "cpu") == 8
    gemma = _arch("tiny-gemma3")
    check_tensor_parallel(gemma, 4, field="workers.tensor_parallel_size", model="m", devices_per_node=4, device="cuda")
    with pytest.raises(TensorParallelError, match=r"workers.tensor_parallel_size=4: .* 1 GPUs"):
        check_tensor_parallel(
            gemma, 4, field="workers.tensor_parallel_size", model="m", devices_per_node=1, device="cuda"
        )


def test_edge_check_names_the_role_field_and_refuses_before_start():
    nodes: list[dict[str, object]] = [{"Alive": True, "Resources": {"CPU": 2.0}}]
    config = load_config("tiny")
    directory = resolve_model_directory(config)
    check_tensor_parallel_at_edge(config, directory, nodes)
    bad = load_config("tiny", ["workers.decode_tensor_parallel_size=3"])
    with pytest.raises(TensorParallelError, match=r"workers.decode_tensor_parallel_size=3 .*tiny-gemma3"):
        check_tensor_parallel_at_edge(bad, directory, nodes)
    too_many = load_config("tiny", ["workers.tensor_parallel_size=4"])
    with pytest.raises(TensorParallelError, match=r"workers.tensor_parallel_size=4: .* 2 CPUs"):
        check_tensor_parallel_at_edge(too_many, directory, nodes)
    valid = load_config("tiny", ["workers.tensor_parallel_size=2"])
    with pytest.raises(TensorParallelError, match=r"workers.tensor_parallel_size=2: .*not served yet"):
        check_tensor_parallel_at_edge(valid, directory, nodes)
