"""Tensor parallelism of the recurrent and MoE families (engine/model/layers/parallel.py): logits
of a worker split over 2 ranks equal Hugging Face's (fp32, atol 1e-4) for Mamba2 (Bamba,
Granite-4.0-H, Nemotron-H), Gated DeltaNet (Qwen3-Next) and sparse MoE (Qwen3-MoE, gpt-oss,
Granite-4.0-H's, Nemotron-H's and Qwen3-Next's) checkpoints, through the real scheduler,
coordinator and runner on every rank; sizes the recurrent mixers cannot be split by are refused
naming the field, the model and the number; and a rank reads only its part of the safetensors
(about 1/N of the model's bytes), the same tensors as cutting the whole ones.

Every checkpoint runs in one group of ranks (one spawn: the ranks' process start dominates a tiny
model's cases), the cases of tests/model/tp_harness.py each.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.checkpoints.loader import build_model, load_hf_directory, read_hf_config
from engine.model.checkpoints.qwen3_gpt_oss_tiny import build_random_checkpoint
from engine.model.checkpoints.tiny import build_tiny_checkpoint
from engine.model.kv_layout import build_kv_layout
from engine.model.layers.parallel import TensorParallelError, check_tensor_parallel, shard_arch, shard_weights
from tests.model.tp_harness import check_ranks_against_hugging_face, sharded_cases

MAMBA2 = ("tiny-bamba", "tiny-granite-h", "tiny-nemotron-h")
DELTANET_MOE = ("tiny-qwen3-next", "tiny-qwen3-moe", "tiny-gpt-oss")


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-families")
    return {
        # one Mamba2 group, shared by the two ranks (Granite-4.0-H and Nemotron-H have two: split)
        "tiny-bamba": build_tiny_checkpoint("tiny-bamba", root / "tiny-bamba", seed=3),
        "tiny-granite-h": build_tiny_checkpoint("tiny-granite-h", root / "tiny-granite-h", seed=3),
        "tiny-nemotron-h": build_tiny_checkpoint("tiny-nemotron-h", root / "tiny-nemotron-h", seed=3),
        "tiny-qwen3-next": build_tiny_checkpoint("tiny-qwen3-next", root / "tiny-qwen3-next", seed=3),
        "tiny-qwen3-moe": build_random_checkpoint("tiny-qwen3-moe", root / "tiny-qwen3-moe", seed=3),
        "tiny-gpt-oss": build_random_checkpoint("tiny-gpt-oss", root / "tiny-gpt-oss", seed=3),
    }


#: per checkpoint, the cases of tests/model/tp_harness.py it runs: the recurrent families the ones
#: that move states (chunked prefill, a prefix hit's state block, a preemption), the MoE-only
#: ones a chunked batch
CASES = {
    **dict.fromkeys((*MAMBA2, "tiny-qwen3-next"), ("chunked", "prefix_hit", "preempt")),
    "tiny-qwen3-moe": ("chunked",),
    "tiny-gpt-oss": ("chunked",),
}


@pytest.fixture(scope="module")
def two_ranks(family_checkpoints) -> list[dict[str, dict[str, dict]]]:
    return sharded_cases(family_checkpoints, 2, CASES)


@pytest.mark.parametrize("name", MAMBA2 + DELTANET_MOE)
def test_logits_split_over_two_ranks_equal_hugging_face(name: str, family_checkpoints, two_ranks) -> None:
    compared = check_ranks_against_hugging_face(family_checkpoints[name], [rank[name] for rank in two_ranks])
    assert compared >= 40  # the chunked batch alone samples 40 rows


def _arch(directory: Path, name: str):
    return dataclasses.replace(arch_from_hf_config(read_hf_config(directory)), architecture=name)


def test_rank_local_recurrent_and_expert_shapes(family_checkpoints) -> None:
    nemotron = _arch(family_checkpoints["tiny-nemotron-h"], "tiny-nemotron-h")
    assert nemotron.mamba is not None and nemotron.moe is not None
    local = shard_arch(nemotron, 2, 1)
    assert local.mamba is not None and local.moe is not None
    assert (local.mamba.num_heads, local.mamba.n_groups) == (
        nemotron.mamba.num_heads // 2,
        nemotron.mamba.n_groups // 2,
    )
    assert local.mamba.state_floats * 2 == nemotron.mamba.state_floats  # a rank keeps its heads' state
    assert local.moe.intermediate_size * 2 == nemotron.moe.intermediate_size
    assert local.moe.num_experts == nemotron.moe.num_experts  # every expert, narrowed
    qwen3_next = _arch(family_checkpoints["tiny-qwen3-next"], "tiny-qwen3-next")
    deltanet = shard_arch(qwen3_next, 2, 0).gated_deltanet
    assert qwen3_next.gated_deltanet is not None and deltanet is not None
    assert (deltanet.num_k_heads, deltanet.num_v_heads) == (1, 2)
    assert deltanet.state_floats * 2 == qwen3_next.gated_deltanet.state_floats


@pytest.mark.parametrize(
    ("name", "change", "size", "words"),
    [
        ("tiny-nemotron-h", {"n_groups": 3}, 2, "3 Mamba2 groups (mamba n_groups) must split evenly"),
        ("tiny-nemotron-h", {"num_heads": 6}, 4, "must divide tiny-nemotron-h's 6 Mamba2 heads (got 4)"),
        ("tiny-qwen3-next", {}, 4, "must divide tiny-qwen3-next's 2 Gated DeltaNet key heads (got 4)"),
    ],
)
def test_sizes_the_recurrent_layers_cannot_split_by_are_refused(
    name: str, change: dict, size: int, words: str, family_checkpoints
) -> None:
    arch = _arch(family_checkpoints[name], name)
    if change:
        assert arch.mamba is not None
        arch = dataclasses.replace(arch, mamba=dataclasses.replace(arch.mamba, **change))
    with pytest.raises(TensorParallelError, match=r"workers\.tensor_parallel_size") as info:
        check_tensor_parallel(arch, size)
    assert words in str(info.value) and f"(got {size})" in str(info.value)


def test_fewer_mamba2_groups_than_ranks_are_shared(family_checkpoints) -> None:
    nemotron = _arch(family_checkpoints["tiny-nemotron-h"], "tiny-nemotron-h")  # 2 groups
    local = [shard_arch(nemotron, 4, rank).mamba for rank in range(4)]
    assert [(m.n_groups, m.group_ranks, m.group) for m in local if m is not None] == [
        (1, 2, 0),
        (1, 2, 0),
        (1, 2, 1),
        (1, 2, 1),
    ]
    check_tensor_parallel(_arch(family_checkpoints["tiny-qwen3-moe"], "tiny-qwen3-moe"), 4)  # heads and experts split


@pytest.mark.parametrize(("name", "size"), [("tiny-qwen3-next", 2), ("tiny-nemotron-h", 2), ("tiny-qwen3-moe", 4)])
def test_a_rank_reads_only_its_part_of_the_checkpoint(name: str, size: int, family_checkpoints) -> None:
    directory = family_checkpoints[name]
    file_bytes = sum(file.stat().st_size for file in directory.glob("*.safetensors"))
    arch, weights = load_hf_directory(directory)
    layout = build_kv_layout(arch, 4, "float32")
    cpu = torch.device("cpu")
    build_model(arch, layout.layer_group, weights, torch.float32, cpu, str(directory))
    assert weights.bytes_read > 0.99 * file_bytes - 16384  # TP=1 reads it all (the header aside)
    local = shard_arch(arch, size, size - 1)
    arch, weights = load_hf_directory(directory)
    model = build_model(local, layout.layer_group, weights, torch.float32, cpu, str(directory), arch.num_kv_heads)
    share = weights.bytes_read / file_bytes
    # replicated: norms, routers, a KV head on two ranks at TP=4 (2 KV heads)
    assert 0.9 / size < share < 1.1 / size + (0.04 if size == 4 else 0), f"{share:.3f}"
    whole = {key: weights[key] for key in weights}  # read everything, then cut: the same tensors
    state = model.state_dict()
    for key, tensor in shard_weights(whole, local, arch.num_kv_heads).items():
        assert torch.equal(state[key], tensor), key
