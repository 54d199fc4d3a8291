"""Two router replicas (``router.replicas: 2``): one is killed while requests run. No request is
lost and none gets a wrong token (the other replica routes the dead one's prefixes meanwhile),
Ray restarts it and the driver registers the workers with it again, their snapshots rebuild its
index, the pin decided before the kill is still held, and a request routed by one replica shows
in the other's view of the worker's load within a bounded time.

Oracles: a single engine's greedy tokens; the workers' own reported prefix hits; the workers'
load reports as each replica holds them.
"""

from __future__ import annotations

import threading
import time

import ray

from engine.kv_cache.hashing import block_hashes
from engine.sampling_params import SamplingParams
from tests.integration.conftest import FAST_HEALTH, GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for

LOAD_VISIBLE_S = 2.0  # a request routed by one replica shows in another's loads within this


def _prompts_per_replica(hash_block_size: int) -> list[list[int]]:
    """Two prompts (a 32-token prefix, a short tail) for each of the two replicas."""
    from cluster.supervisor import replica_for

    chosen: dict[int, list[list[int]]] = {0: [], 1: []}
    for seed in range(100, 200):
        prefix = random_prompts(seed, [32])[0]
        replica = replica_for(block_hashes(prefix, hash_block_size, None), 2)
        if len(chosen[replica]) < 2:
            chosen[replica].append(prefix + random_prompts(seed + 1000, [7])[0])
        if all(len(p) == 2 for p in chosen.values()):
            return chosen[0] + chosen[1]
    raise AssertionError("no prefixes for both replicas")


def test_replica_killed_under_load_loses_no_request_and_rebuilds(ray_session):
    from cluster.api import Cluster, ClusterCompletion

    config = cluster_config("tiny", 1, 2, *FAST_HEALTH, "router.replicas=2")
    pinned = random_prompts(9, [40])[0]
    with Cluster(config) as cluster:
        assert len(cluster.routers) == 2
        prompts = _prompts_per_replica(cluster.model.hash_block_size)
        expected = oracle_tokens(config, prompts)
        pin_id = cluster.pin_prefix(pinned, replicas=1, ttl=600)
        assert [r.token_ids for r in cluster.generate(prompts, GREEDY)] == expected
        wait_for(lambda: None not in cluster.router_incarnations, 30, "the driver to know the replicas")

        # kill the replica that decides the pins while a batch runs
        leader = ray.get(cluster.routers[0].pin_leader.remote(), timeout=30)
        assert leader in (0, 1)
        during: list[ClusterCompletion] = []
        batch = threading.Thread(target=lambda: during.extend(cluster.generate(prompts * 6, GREEDY)))
        batch.start()
        time.sleep(0.1)
        ray.kill(cluster.routers[leader], no_restart=False)  # Ray restarts it
        batch.join(timeout=300)
        assert not batch.is_alive()
        assert [r.token_ids for r in during] == expected * 6
        # the live replica routed the dead one's prefixes: no request needed the fallback
        assert not [r.route_reason for r in during if r.route_reason == "fallback"]

        wait_for(lambda: cluster.router_rejoins >= 1, 120, "the workers registered with the restarted replica")

        # both replicas route on a full index again: each prompt is predicted as cached (by
        # whichever replica its prefix picks), and the prediction is what the worker finds
        def predicted() -> bool:
            done = cluster.generate(prompts, GREEDY)
            assert [r.token_ids for r in done] == expected
            return all(r.route_reason != "fallback" and r.predicted_hit == r.cached_tokens >= 32 for r in done)

        wait_for(predicted, 60, "routing on the rebuilt index", interval_s=0.5)
        replicas = cluster.stats()["router"]["replicas"]
        assert [r["replica"] for r in replicas] == [0, 1] and all(r["routed"] > 0 for r in replicas)

        # the pin decided before the kill is held (restored by whichever replica leads now)
        wait_for(lambda: any(p["pin_id"] == pin_id and p["active"] for p in cluster.pins()), 60, "the pin held")
        assert cluster.unpin(pin_id)
        assert not any(p["pin_id"] == pin_id for p in cluster.pins())

        # a request one replica routes shows in the other replica's view of the worker's load
        long = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
        stream = threading.Thread(target=lambda: cluster.generate([prompts[0]], long))
        stream.start()
        started = time.monotonic()

        def both_see_it() -> bool:
            views = [ray.get(r.stats.remote(), timeout=10)["loads"] for r in cluster.routers]
            return all(any(load["running_requests"] > 0 for load in view.values()) for view in views)

        wait_for(both_see_it, LOAD_VISIBLE_S, "both replicas to see the running request", interval_s=0.02)
        assert time.monotonic() - started <= LOAD_VISIBLE_S + 0.5
        stream.join(timeout=300)
        assert cluster.health() == {"prefill-0": "ok", "decode-0": "ok", "decode-1": "ok"}
