"""A rank's slice of the checkpoint (engine/model/sharding.py), checked without a process group:
the ranks' slices put back together are the full weights, replicated key/value heads follow the
query heads they serve, and families not split yet are refused by name."""

from __future__ import annotations

import pytest
import torch

from engine.model.checkpoints.loader import load_hf_directory
from engine.model.checkpoints.tiny import build_tiny_checkpoint
from engine.model.sharding import RankShard
from engine.model.tensor_parallel import TensorParallelError


def test_slices_reassemble_the_checkpoint(tmp_path) -> None:
    arch, weights = load_hf_directory(build_tiny_checkpoint("tiny-gemma3", tmp_path / "g", seed=3))
    shards = [RankShard(r, 2).shard_weights(arch, weights) for r in range(2)]
    prefix = "model.layers.0."
    for name, dim in (("self_attn.q_proj.weight", 0), ("self_attn.k_proj.weight", 0), ("mlp.up_proj.weight", 0)):
        assert torch.equal(torch.cat([s[prefix + name] for s in shards], dim), weights[prefix + name])
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert torch.equal(torch.cat([s[prefix + name] for s in shards], 1), weights[prefix + name])
    assert torch.equal(shards[1]["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    local = RankShard(1, 2).local_arch(arch)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, arch.intermediate_size // 2)
    full = sum(t.numel() for t in weights.values())
    split = sum(t.numel() for t in shards[0].values())
    assert split < full  # the projections shrink; embeddings and norms stay whole


def test_four_ranks_replicate_each_key_value_head_for_its_query_heads(tmp_path) -> None:
    arch, weights = load_hf_directory(build_tiny_checkpoint("tiny-gemma3", tmp_path / "g", seed=3))
    d, k = arch.head_dim, weights["model.layers.0.self_attn.k_proj.weight"]
    assert arch.num_heads == 4 and arch.num_kv_heads == 2
    for rank in range(4):  # query head r uses key/value head r // 2
        mine = RankShard(rank, 4).shard_weights(arch, weights)["model.layers.0.self_attn.k_proj.weight"]
        kv = rank // 2
        assert torch.equal(mine, k[kv * d : (kv + 1) * d])


def test_families_not_split_yet_are_refused(tmp_path) -> None:
    arch, _ = load_hf_directory(build_tiny_checkpoint("tiny-bamba", tmp_path / "b", seed=3))
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=2: model .* \(bamba\) is not sharded yet"):
        RankShard(0, 2).check(arch, "tiny-bamba")
