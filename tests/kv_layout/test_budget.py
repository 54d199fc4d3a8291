"""memory_budget sizing: running states reserved, cached states bounded, attention the rest."""

from __future__ import annotations

import pytest

from engine.model.kv_budget import MIN_CACHED_STATES, STATES_PER_RUNNING_REQUEST, split_budget
from engine.model.kv_layout import build_kv_layout
from tests.kv_layout.shapes import bamba_9b, with_layers

GIB = 2**30


def test_running_states_are_reserved_and_the_rest_goes_mostly_to_attention() -> None:
    layout = build_kv_layout(bamba_9b(), 16, "bfloat16")
    attention, state = layout.pools
    split = split_budget(layout, 40 * GIB, max_num_seqs=32, state_cache_fraction=0.05)
    reserved = 32 * STATES_PER_RUNNING_REQUEST + 1  # one Mamba group; + null block
    assert split.num_blocks[1] == reserved + split.cached_states
    assert split.reserved_bytes == reserved * state.block_bytes
    rest = 40 * GIB - split.reserved_bytes
    assert split.cached_state_bytes <= 0.05 * rest and split.cached_states == int(0.05 * rest) // state.block_bytes
    assert split.num_blocks[0] == (rest - split.cached_state_bytes) // attention.block_bytes
    used = split.num_blocks[0] * attention.block_bytes + split.num_blocks[1] * state.block_bytes
    assert used <= 40 * GIB and 40 * GIB - used < attention.block_bytes
    assert layout.pool_bytes(split.num_blocks) == used


def test_expected_prefix_length_caps_cached_states_at_one_per_prefix() -> None:
    layout = build_kv_layout(bamba_9b(), 16, "bfloat16")
    loose = split_budget(layout, 40 * GIB, 32, state_cache_fraction=0.5)
    tight = split_budget(layout, 40 * GIB, 32, state_cache_fraction=0.5, expected_prefix_tokens=32768)
    assert tight.cached_states < loose.cached_states and tight.num_blocks[0] > loose.num_blocks[0]
    prefixes = layout.capacity(tight.num_blocks)["tokens"] / 32768
    assert prefixes <= tight.cached_states <= prefixes + 2


def test_a_small_budget_still_caches_a_few_states_but_at_most_half_the_rest() -> None:
    layout = build_kv_layout(bamba_9b(), 16, "bfloat16")
    state = layout.pools[1].block_bytes  # one Mamba group: a cached state is one block
    split = split_budget(layout, 8 * GIB, max_num_seqs=4)
    assert int(0.05 * (8 * GIB - split.reserved_bytes)) // state == 2  # what the fraction alone gives
    assert split.cached_states == MIN_CACHED_STATES
    assert split_budget(layout, 8 * GIB, 4, state_cache_fraction=0.0).cached_states == 0
    tight = split_budget(layout, 2 * GIB, max_num_seqs=4)
    assert 0 < tight.cached_states == (2 * GIB - tight.reserved_bytes) // 2 // state < MIN_CACHED_STATES


def test_a_budget_below_the_running_states_is_refused_by_name() -> None:
    layout = build_kv_layout(bamba_9b(), 16, "bfloat16")
    with pytest.raises(ValueError, match="max_num_seqs=64"):
        split_budget(layout, 2 * GIB, max_num_seqs=64)


def test_one_pool_is_budget_over_block_bytes() -> None:
    arch = with_layers(bamba_9b(), ["sliding", "full"] * 3)
    layout = build_kv_layout(arch, 16, "float32")
    split = split_budget(layout, 512 * 2**20, max_num_seqs=64)
    assert split.num_blocks == (512 * 2**20 // layout.pools[0].block_bytes,)
    only_mamba = build_kv_layout(with_layers(arch, ["mamba"] * 4), 16, "float32")
    assert split_budget(only_mamba, GIB, 8).num_blocks == (GIB // only_mamba.pools[0].block_bytes,)


def test_engine_sizes_pools_from_the_config_and_reports_capacity(tmp_path) -> None:
    """A tiny Bamba engine with a memory budget: its pools follow split_budget, and stats()
    reports capacity in tokens and recurrent states."""
    from configs.load import load_config
    from engine.core import EngineCore

    config = load_config(
        "tiny-hybrid",
        [
            f"model.weights_cache_dir={tmp_path}",
            "kv_cache.num_blocks=null",
            "kv_cache.memory_budget_mib=4",
            "kv_cache.pinning.budget_blocks=null",
            "kv_cache.state_cache_fraction=0.1",
        ],
    )
    engine = EngineCore(config, threads=1)
    try:
        layout = engine.layout
        split = split_budget(layout, 4 * 2**20, config.scheduler.max_num_seqs, 0.1)
        assert engine.info.pool_blocks == split.num_blocks and len(split.num_blocks) == 2
        capacity = engine.worker_view.stats()["capacity"]
        assert capacity["tokens"] == layout.capacity(split.num_blocks)["tokens"] > 0
        assert capacity["recurrent_states"] == split.num_blocks[1] - 1 >= config.scheduler.max_num_seqs * 2
        assert [p["num_blocks"] for p in capacity["pools"]] == [n - 1 for n in split.num_blocks]
        assert capacity["bytes"] <= 4 * 2**20
        from cluster.supervisor import worker_summary  # what Cluster.stats() and /v1/stats show per worker

        line = worker_summary({**engine.worker_view.stats(), "role": "decode", "worker_id": "w", "hit_rate": 0.0})
        assert line["capacity_tokens"] == capacity["tokens"]
        assert line["capacity_recurrent_states"] == capacity["recurrent_states"]
        assert [p["kind"] for p in line["kv_pools"]] == ["attention", "state"]
    finally:
        engine.close()
