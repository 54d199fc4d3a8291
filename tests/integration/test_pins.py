"""Pinned prefixes on a real cluster: a pin survives a flood of unique requests that overflows
the cache (an unpinned prefix computed just before it does not), TTLs expire, unpin removes.

Oracle: the worker's own reported prefix hit for a request starting with the prefix, and the
router's prediction for it.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import GREEDY, cluster_config, random_prompts, wait_for

NUM_BLOCKS = 96  # per worker; a flood request of 100 tokens takes ~50 of them (2 groups x 25)


@pytest.fixture(scope="module")
def cluster(ray_session):
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 1, f"kv_cache.num_blocks={NUM_BLOCKS}", "kv_cache.pinning.budget_blocks=16")
    with Cluster(config) as c:
        yield c


def test_pinned_prefix_survives_a_flood_that_overflows_the_cache(cluster):
    pinned, control = random_prompts(61, [80, 80])
    pin_id = cluster.pin_prefix(pinned, replicas=1)
    (pin,) = [p for p in cluster.pins() if p["pin_id"] == pin_id]
    assert pin["active"] == ["prefill-0"], pin
    tail = random_prompts(62, [10])[0]
    warm = cluster.generate([control + tail], GREEDY)[0]
    assert warm.prefill_worker == "prefill-0"

    # One at a time: each request fits beside the pin, so the pool never has to demote it, while
    # the flood as a whole cycles both pools many times over.
    flood = random_prompts(63, [100] * 24)
    flooded = sum(len(cluster.generate([prompt], GREEDY)[0].prompt_token_ids) for prompt in flood)
    assert flooded > 2 * NUM_BLOCKS * 4 * 2  # far more tokens than both pools hold

    (pin,) = [p for p in cluster.pins() if p["pin_id"] == pin_id]
    assert pin["active"] == ["prefill-0"], "the pin was never lost"
    hit = cluster.generate([pinned + tail], GREEDY)[0]
    miss = cluster.generate([control + tail], GREEDY)[0]
    assert hit.prefill_worker == "prefill-0", hit
    assert hit.cached_tokens == hit.predicted_hit == 80
    assert miss.cached_tokens == miss.predicted_hit == 0, "the unpinned prefix was evicted by the flood"
    assert cluster.stats()["workers"]["prefill-0"]["pinned_blocks"] > 0
    assert cluster.unpin(pin_id)
    assert not any(p["pin_id"] == pin_id for p in cluster.pins())
    assert not cluster.unpin(pin_id)


def test_pin_ttl_expires_and_pin_errors_name_the_field(cluster):
    prefix = random_prompts(71, [40])[0]
    pin_id = cluster.pin_prefix(prefix, replicas=1, ttl=0.5)
    assert any(p["pin_id"] == pin_id for p in cluster.pins())
    time.sleep(0.7)
    wait_for(lambda: not any(p["pin_id"] == pin_id for p in cluster.pins()), 5, "the pin's TTL to expire")
    with pytest.raises(ValueError, match=r"replicas: must be >= 1 \(got 0\)"):
        cluster.pin_prefix(prefix, replicas=0)
    with pytest.raises(ValueError, match=r"prefix: must not be empty"):
        cluster.pin_prefix("")
    with pytest.raises(ValueError, match=r"ttl: must be > 0 seconds \(got -1"):
        cluster.pin_prefix(prefix, ttl=-1)
    with pytest.raises(ValueError, match=r"replicas=3 but only 1 workers can hold pins"):
        cluster.pin_prefix(prefix, replicas=3)
