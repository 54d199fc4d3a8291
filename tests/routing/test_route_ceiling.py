"""``benchmarks.support.route_replay``: the placement replay behind ``benchmarks/route_ceiling.py``,
on the tiny sliding-window preset and the tiny Bamba preset (real coordinators, no cluster)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.support.route_replay import PLACEMENTS, replay, route_ceiling
from configs import load_config
from engine.kv_cache.spec import alignment_tokens
from kvfleet_testing.sizing import kv_groups, vocab_size
from kvfleet_testing.workloads import HybridWorkload, hit_rate_bound

WORKLOAD = HybridWorkload(num_prefixes=4, num_requests=24, prefix_tokens=96, sweep_tokens=8, max_tokens=4)


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_every_placement_stays_under_the_unbounded_bound_and_the_tree_beats_round_robin(preset):
    config = load_config(preset, ["workers.num_prefill=2", "workers.num_decode=1"])
    out = route_ceiling(config, WORKLOAD)
    assert out["num_workers"] == 2
    for placement in PLACEMENTS:
        assert 0.0 <= out[placement]["hit_rate"] <= out["bound"] + 1e-9, placement
        assert sum(out[placement]["requests_per_worker"]) == WORKLOAD.num_requests
    assert out["prefix_tree"]["hit_rate"] > out["round_robin"]["hit_rate"] > 0.0
    assert out["exact_oracle"]["hit_rate"] > out["round_robin"]["hit_rate"]


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_with_room_for_every_prefix_kvfleet_hits_as_the_oracle_does(preset):
    """A pool far above the prefix set: nothing is evicted, so kvfleet's exact policy finds what
    the perfect-knowledge oracle finds (the bound stays above both: a sliding window allocated
    chunk by chunk never caches the blocks a chunk skips, so not every shared length can hit)."""
    config = load_config(preset, ["workers.num_prefill=2", "workers.num_decode=1"])
    roomy = replace(WORKLOAD, cache_fraction=4.0, flood_share=0.0)
    bound = hit_rate_bound(roomy.prompts(vocab_size(config)), alignment_tokens(kv_groups(config)))
    oracle = replay(config, roomy, "exact_oracle", 2)["hit_rate"]
    assert 0.3 < oracle <= bound
    assert replay(config, roomy, "kvfleet", 2)["hit_rate"] == pytest.approx(oracle)


def test_an_unknown_placement_is_refused_by_name():
    config = load_config("tiny", ["workers.num_prefill=2", "workers.num_decode=1"])
    with pytest.raises(ValueError, match=r"placement: .*'nearest'"):
        replay(config, WORKLOAD, "nearest", 2)
