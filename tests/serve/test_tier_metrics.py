"""The KV tiers in /v1/stats and /metrics, through the real HTTP server.

A third application (``tiered``, route ``/tiered``) runs tiny Gemma3 1P+1D with a small device
KV and the host tier on (``kv_cache.offload``). Prompt A is served, a flood of unrelated prompts
evicts it from both workers' device pools (offloaded to host memory), and A again is served from
the host tier (promoted). Oracles: the counters move as the engine did (offloads after the
flood, promotes after A again, bytes and seconds with them), A's second answer reports cached
prompt tokens, and every /metrics series equals the /v1/stats value it renders. On the ``main``
application (no host tier) every hit is a device hit.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cluster.tier_stats import hit_tokens_by_tier, hit_tokens_by_tier_totals, host_tier_summary, host_tier_totals
from configs import load_config
from tests.serve.conftest import Server, all_blocks_free, wait_for
from tests.serve.test_operations import metric_values

TIERED_ROUTE = "/tiered"
TIERED = [
    "kv_cache.num_blocks=96",
    "kv_cache.offload.enabled=true",
    "kv_cache.offload.size_mib=16",
    "serve.served_model_name=tiny-tiered",
    "serve.max_queued_requests=64",
]


@pytest.fixture(scope="module")
def tiered(servers: dict[str, Server]) -> Iterator[Server]:
    from ray import serve

    from serving.app import kvfleet_app

    root = servers["main"].base  # the main application answers at the root route
    config = load_config("tiny", TIERED)
    serve.run(kvfleet_app(config), name="tiered", route_prefix=TIERED_ROUTE, blocking=False)
    try:
        yield Server(root + TIERED_ROUTE, config, "tiered", None)
    finally:
        serve.delete("tiered")


def complete(server: Server, prompt: list[int]) -> dict[str, Any]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.base}/v1/completions", json=body, headers=server.headers(), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def host_totals(server: Server) -> dict[str, Any]:
    totals = server.totals()["host_tier"]
    assert totals is not None
    return totals


def test_a_prefix_evicted_to_the_host_tier_and_back_moves_every_tier_series(tiered: Server) -> None:
    rng = random.Random(11)
    a = [rng.randrange(3, 250) for _ in range(150)]
    flood = [[rng.randrange(3, 250) for _ in range(150)] for _ in range(6)]
    stats = tiered.get("/v1/stats").json()
    assert set(stats["workers"]) == {"prefill-0", "decode-0"}
    for worker in stats["workers"].values():
        host = worker["host_tier"]
        assert host is not None and host["num_blocks"] > 0 and host["offloaded_blocks"] == 0
        assert host["num_blocks"] == sum(p["num_blocks"] for p in host["pools"])

    complete(tiered, a)
    for prompt in flood:
        complete(tiered, prompt)
    wait_for(all_blocks_free(tiered), 10, "an idle tiered cluster after the flood")
    offloaded = host_totals(tiered)
    assert offloaded["offloaded_blocks"] > 0 and offloaded["bytes_offloaded"] > 0
    assert offloaded["offload_seconds"] > 0 and 0 < offloaded["occupancy"] <= 1
    assert offloaded["cached_blocks"] > 0
    assert offloaded["promoted_blocks"] == 0 and offloaded["bytes_promoted"] == 0

    again = complete(tiered, a)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wait_for(all_blocks_free(tiered), 10, "an idle tiered cluster after A again")
    stats = tiered.get("/v1/stats").json()
    promoted = stats["totals"]["host_tier"]
    assert promoted["promoted_blocks"] > 0 and promoted["bytes_promoted"] > 0 and promoted["promote_seconds"] > 0
    assert promoted["copy_seconds"] >= promoted["offload_seconds"] + promoted["promote_seconds"] - 1e-9
    split = stats["totals"]["hit_tokens_by_tier"]
    if split is not None:  # engines that count hits per tier: the host served A's second prompt
        assert split["device"] + split["host"] == stats["totals"]["hit_tokens"]
        assert split["host"] > 0

    values = metric_values(tiered)
    for worker_id, worker in stats["workers"].items():
        who = f"|role={worker['role']}|worker_id={worker_id}"
        host = worker["host_tier"]
        for p, pool in enumerate(host["pools"]):
            assert values[f"kvfleet_host_tier_blocks|pool={p}{who}"] == pool["num_blocks"]
            assert values[f"kvfleet_host_tier_cached_blocks|pool={p}{who}"] == pool["cached_blocks"]
        assert values[f"kvfleet_host_tier_occupancy{who}"] == pytest.approx(host["occupancy"])
        for move in ("offloaded", "refreshed", "dropped", "promoted"):
            assert values[f"kvfleet_host_tier_block_moves_total|move={move}{who}"] == host[f"{move}_blocks"]
        for direction, key in (("offload", "bytes_offloaded"), ("promote", "bytes_promoted")):
            assert values[f"kvfleet_host_tier_copy_bytes_total|direction={direction}{who}"] == host[key]
        seconds = values[f"kvfleet_host_tier_copy_seconds_total|direction=promote{who}"]
        assert seconds == pytest.approx(host["promote_seconds"])
    assert (
        sum(values[k] for k in values if k.startswith("kvfleet_host_tier_block_moves_total|move=promoted"))
        == (promoted["promoted_blocks"])
    )


def test_without_a_host_tier_every_hit_is_a_device_hit(server: Server) -> None:
    prompt = "the same long question, asked twice over " * 3
    for _ in range(2):
        server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    stats = server.get("/v1/stats").json()
    assert stats["totals"]["host_tier"] is None
    assert stats["totals"]["hit_tokens"] > 0
    assert stats["totals"]["hit_tokens_by_tier"] == {"device": stats["totals"]["hit_tokens"], "host": 0}
    values = metric_values(server)
    for worker_id, worker in stats["workers"].items():
        assert worker["host_tier"] is None
        hits = f"kvfleet_worker_hit_tokens_total|role={worker['role']}|tier={{}}|worker_id={worker_id}"
        assert values[hits.format("device")] == worker["hit_tokens"]
        assert values[hits.format("host")] == 0
        assert not any(k.startswith("kvfleet_host_tier_") and worker_id in k for k in values)


def test_the_tier_rules_over_engine_stats() -> None:
    """``cluster.tier_stats`` on engine stats of each shape: no tier, a tier that splits its hits,
    a tier whose engine does not (the split is unknown, and so is the cluster's)."""
    host = {
        "pools": [{"num_blocks": 10, "cached_blocks": 4}, {"num_blocks": 6, "cached_blocks": 0}],
        "offloaded": 5,
        "refreshed": 1,
        "dropped": 0,
        "promoted": 2,
        "bytes_offloaded": 500,
        "bytes_promoted": 200,
        "copy_seconds": 0.5,
        "offload_seconds": 0.3,
        "promote_seconds": 0.1,
        "host_bytes": 1600,
    }
    plain = {"hit_tokens": 12, "host_tier": None}
    split = {"hit_tokens": 30, "host_tier": {**host, "hit_tokens": {"device": 18, "host": 12}}}
    unsplit = {"hit_tokens": 30, "host_tier": host}
    assert hit_tokens_by_tier(plain) == {"device": 12, "host": 0}
    assert hit_tokens_by_tier(split) == {"device": 18, "host": 12}
    assert hit_tokens_by_tier(unsplit) is None
    summary = host_tier_summary(split)
    assert summary is not None
    assert (summary["num_blocks"], summary["cached_blocks"], summary["occupancy"]) == (16, 4, 0.25)
    assert (summary["offloaded_blocks"], summary["promoted_blocks"], summary["bytes_promoted"]) == (5, 2, 200)
    workers = {
        w: {"hit_tokens_by_tier": hit_tokens_by_tier(s), "host_tier": host_tier_summary(s)}
        for w, s in (("a", plain), ("b", split))
    }
    assert hit_tokens_by_tier_totals(workers) == {"device": 30, "host": 12}
    totals = host_tier_totals(workers)
    assert totals is not None and totals["workers"] == 1 and totals["bytes_offloaded"] == 500
    workers["c"] = {"hit_tokens_by_tier": hit_tokens_by_tier(unsplit), "host_tier": host_tier_summary(unsplit)}
    assert hit_tokens_by_tier_totals(workers) is None
    totals = host_tier_totals(workers)
    assert totals is not None and totals["workers"] == 2 and totals["occupancy"] == 8 / 32
    assert host_tier_totals({"a": workers["a"]}) is None
