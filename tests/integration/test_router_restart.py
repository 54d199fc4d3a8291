"""The router actor dies: Ray restarts it, requests arriving meanwhile run without it (exact tokens,
none lost), the driver registers every worker with the new router, the workers' snapshots rebuild
its prefix index, and the explicit pins come back under their ids.

Oracles: a single engine's greedy tokens; the workers' own reported prefix hits.
"""

from __future__ import annotations

import ray

from tests.integration.conftest import FAST_HEALTH, GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for


def test_router_restart_loses_no_request_and_rebuilds_index_and_pins(ray_session):
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 2, *FAST_HEALTH)
    shared = random_prompts(7, [32])[0]
    prompts = [shared + tail for tail in random_prompts(8, [5, 9, 13, 17])]
    pinned = random_prompts(9, [40])[0]
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        pin_id = cluster.pin_prefix(pinned, replicas=1, ttl=600)
        assert [r.token_ids for r in cluster.generate(prompts, GREEDY)] == expected
        before = ray.get(cluster.router.identity.remote(), timeout=30)
        wait_for(lambda: cluster.router_incarnation == before, 30, "the driver to know the router")

        ray.kill(cluster.router, no_restart=False)  # Ray restarts it
        during = cluster.generate(prompts * 2, GREEDY)
        assert [r.token_ids for r in during] == expected * 2

        wait_for(lambda: cluster.router_rejoins == 1, 120, "the workers registered with the new router")
        assert ray.get(cluster.router.identity.remote(), timeout=30) != before
        stats = cluster.stats()
        assert set(stats["router"]["loads"]) == {"prefill-0", "decode-0", "decode-1"}

        # the snapshots rebuilt the index: a prompt the cluster holds is predicted as cached, and
        # the prediction is what the worker then finds
        def predicted() -> bool:
            result = cluster.generate([prompts[0]], GREEDY)[0]
            assert result.token_ids == expected[0]
            return result.route_reason != "fallback" and result.predicted_hit >= 32

        wait_for(predicted, 60, "routing on the rebuilt index", interval_s=0.5)
        again = cluster.generate([prompts[1]], GREEDY)[0]
        assert again.token_ids == expected[1] and again.predicted_hit == again.cached_tokens >= 32

        wait_for(lambda: any(p["pin_id"] == pin_id and p["active"] for p in cluster.pins()), 60, "the pin restored")
        (pin,) = [p for p in cluster.pins() if p["pin_id"] == pin_id]
        assert pin["replicas"] == 1 and pin["num_tokens"] == 40
        assert cluster.unpin(pin_id)
        assert not any(p["pin_id"] == pin_id for p in cluster.pins())
        assert cluster.health() == {"prefill-0": "ok", "decode-0": "ok", "decode-1": "ok"}
