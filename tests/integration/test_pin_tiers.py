"""A device-tier pin on a real cluster with the host tier on: long requests make the holder's
device give the pinned blocks up, which go to its host tier still pinned; the router keeps the
holder (no Unpin, no re-placement), reports it in the host tier, and a request with the prefix is
routed there and served from the host tier; the promote pins it on the device again.

Oracles: the worker's own reported hit (cached tokens, and its stats' host-tier hit tokens) for a
request starting with the prefix, and the router's prediction for it.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import GREEDY, cluster_config, random_prompts, wait_for

NUM_BLOCKS = 96  # per worker and group pool; a 240-token request takes 60 full-attention blocks


@pytest.fixture(scope="module")
def cluster(ray_session):
    from cluster.api import Cluster

    config = cluster_config(
        "tiny",
        1,
        1,
        f"kv_cache.num_blocks={NUM_BLOCKS}",
        "kv_cache.pinning.budget_blocks=16",
        "kv_cache.offload.enabled=true",
        "kv_cache.offload.size_mib=16",
    )
    with Cluster(config) as c:
        yield c


def the_pin(cluster: Any, pin_id: int) -> dict[str, Any]:
    (pin,) = [p for p in cluster.pins() if p["pin_id"] == pin_id]
    return pin


def host_hit_tokens(cluster: Any, worker: str) -> int:
    return int(cluster.stats()["workers"][worker]["hit_tokens_by_tier"]["host"])


def test_a_device_pin_offloaded_by_its_holder_stays_there_and_comes_back_on_a_hit(cluster):
    pinned = random_prompts(81, [80])[0]
    pin_id = cluster.pin_prefix(pinned, replicas=1)
    pin = the_pin(cluster, pin_id)
    assert pin["active"] == ["prefill-0"] and pin["holder_tiers"] == {"prefill-0": "device"}, pin

    # Each flood request needs more blocks than the pool has beside the pin, so the pool demotes
    # pinned blocks (offloaded, pinned, to the host tier); the router's view follows its reports.
    for i, prompt in enumerate(random_prompts(82, [240] * 6)):
        cluster.generate([prompt], GREEDY)
        pin = the_pin(cluster, pin_id)
        assert pin["active"] == ["prefill-0"] and pin["pending"] == [], (i, pin)  # never dropped
        if pin["holder_tiers"] == {"prefill-0": "host"}:
            break
    else:
        pytest.fail(f"the flood never moved the pin to the host tier: {pin}")
    assert pin["tier"] == "device"

    before = host_hit_tokens(cluster, "prefill-0")
    tail = random_prompts(83, [10])[0]
    hit = cluster.generate([pinned + tail], GREEDY)[0]
    assert hit.prefill_worker == "prefill-0", hit
    assert hit.cached_tokens == hit.predicted_hit == 80
    assert host_hit_tokens(cluster, "prefill-0") > before  # served (in part) from the host tier
    on_device = {"prefill-0": "device"}
    wait_for(lambda: the_pin(cluster, pin_id)["holder_tiers"] == on_device, 10, "the promoted pin on the device")
    assert cluster.unpin(pin_id)
