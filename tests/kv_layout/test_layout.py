"""The pooled KV layout: pools per page size, group sizes, slots, and the single-pool case."""

from __future__ import annotations

import pytest

from engine.kv_cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from engine.model.kv_layout import (
    attention_page_bytes,
    build_kv_layout,
    mamba_page_bytes,
    padded_page_bytes,
)
from tests.kv_layout.shapes import bamba_9b, with_layers


def check_layout(layout, arch) -> None:
    """The layout's own invariants, then the same by hand: every cache layer has one (pool,
    group, slot); groups of a pool use distinct slots per layer; the pool kind matches."""
    layout.check_invariants(arch)
    seen = set()
    for i, layer in enumerate(arch.layers):
        g, p, s = layout.layer_group[i], layout.layer_pool[i], layout.layer_slot[i]
        if layer.kind == "mlp":
            assert (g, p, s) == (-1, -1, -1)
            continue
        assert layout.groups[g].pool == p and 0 <= s < layout.pools[p].num_slots
        assert f"layers.{i}" in layout.groups[g].layer_names
        assert (g, s) not in seen
        seen.add((g, s))
        kind = "state" if layer.kind == "mamba" else "attention"
        assert layout.pools[p].kind == kind
    assert layout.slot_pool == tuple(sorted(layout.slot_pool))
    for p, pool in enumerate(layout.pools):
        assert pool.num_groups == len(layout.groups_in(p))


def test_bamba_9b_pages_are_not_padded() -> None:
    arch = bamba_9b()
    layout = build_kv_layout(arch, 16, "bfloat16")
    check_layout(layout, arch)
    assert [(p.kind, p.page_bytes, p.num_slots, p.num_groups, p.unused_slot_pages) for p in layout.pools] == [
        ("attention", 65536, 3, 1, 0),  # 16 tokens x K,V x 8 heads x 128 x bf16
        ("state", 4329472, 29, 1, 0),  # one Mamba2 layer's fp32 conv + SSM state
    ]
    assert padded_page_bytes(arch, 16, "bfloat16") == 4329472  # the shared page of before: 66x the attention page
    assert [type(g.spec) for g in layout.groups] == [FullAttentionSpec, MambaSpec]
    assert layout.slot_page_bytes == (65536,) * 3 + (4329472,) * 29


@pytest.mark.parametrize(
    "kinds",
    [
        ["full"] * 4,
        ["sliding", "full"] * 3,
        ["sliding"] * 5 + ["full"] + ["sliding"] * 5 + ["full"] + ["sliding"] * 5 + ["full"],  # Gemma 3's 5:1
        ["sliding", "sliding", "full"],
    ],
)
def test_one_pool_keeps_the_single_page_layout(kinds: list[str]) -> None:
    """Pure attention: one pool, the attention page, and the groups of the shared-page rule
    (buckets cut by the smallest bucket's size)."""
    arch = with_layers(bamba_9b(), kinds)
    layout = build_kv_layout(arch, 16, "float32")
    check_layout(layout, arch)
    assert len(layout.pools) == 1 and layout.pools[0].page_bytes == attention_page_bytes(arch, 16, "float32")
    assert layout.pools[0].page_bytes == padded_page_bytes(arch, 16, "float32")
    smallest = min(kinds.count(k) for k in set(kinds))
    assert layout.pools[0].num_slots == smallest
    assert len(layout.groups) == sum(-(-kinds.count(k) // smallest) for k in set(kinds))


def test_group_size_per_pool_leaves_no_slot_unused() -> None:
    """7 full + 14 sliding attention and 9 Mamba layers: attention groups of 7 (one full, two
    sliding), one Mamba group of 9; no pool has an unused slot page."""
    kinds = ["full"] * 7 + ["sliding"] * 14 + ["mamba"] * 9 + ["mlp"] * 2
    arch = with_layers(bamba_9b(), kinds)
    layout = build_kv_layout(arch, 16, "bfloat16")
    check_layout(layout, arch)
    assert [(p.num_slots, p.num_groups, p.unused_slot_pages) for p in layout.pools] == [(7, 3, 0), (9, 1, 0)]
    assert sorted(type(g.spec).__name__ for g in layout.groups) == [
        "FullAttentionSpec",
        "MambaSpec",
        "SlidingWindowSpec",
        "SlidingWindowSpec",
    ]


def test_group_size_falls_back_to_the_smallest_bucket_when_exact_groups_explode() -> None:
    """5 full and 7 sliding layers divide only by 1 (12 groups); cutting by 5 gives 3 groups and
    3 unused slot pages, the bounded price for a coordinator 4x lighter."""
    arch = with_layers(bamba_9b(), ["full"] * 5 + ["sliding"] * 7)
    layout = build_kv_layout(arch, 16, "bfloat16")
    check_layout(layout, arch)
    assert (layout.pools[0].num_slots, len(layout.groups), layout.pools[0].unused_slot_pages) == (5, 3, 3)


def test_capacity_counts_tokens_and_states_without_null_blocks() -> None:
    arch = with_layers(bamba_9b(), ["mamba", "full", "mamba", "sliding", "mamba", "full", "mamba", "sliding"])
    layout = build_kv_layout(arch, 16, "bfloat16")
    assert [(p.kind, p.num_slots, p.num_groups) for p in layout.pools] == [("attention", 2, 2), ("state", 4, 1)]
    assert layout.capacity((101, 11)) == {"tokens": 50 * 16, "recurrent_states": 10}
    assert layout.pool_bytes((101, 11)) == 101 * 2 * attention_page_bytes(
        arch, 16, "bfloat16"
    ) + 11 * 4 * mamba_page_bytes(arch)
    assert isinstance(layout.groups[1].spec, SlidingWindowSpec)


def test_check_invariants_catches_a_state_layer_in_the_attention_pool() -> None:
    import dataclasses

    arch = bamba_9b()
    layout = build_kv_layout(arch, 16, "bfloat16")
    mamba = next(i for i, layer in enumerate(arch.layers) if layer.kind == "mamba")
    pools = list(layout.layer_pool)
    pools[mamba] = 0
    with pytest.raises(AssertionError):
        dataclasses.replace(layout, layer_pool=tuple(pools)).check_invariants(arch)
    slots = list(layout.layer_slot)
    slots[9], slots[18] = 0, 0  # two attention layers of one group on one slot
    with pytest.raises(AssertionError, match="taken twice"):
        dataclasses.replace(layout, layer_slot=tuple(slots)).check_invariants(arch)
