"""A worker that dies: requests routed to it before it was noticed run again elsewhere (they had
streamed nothing), the router forgets it, and the cluster keeps giving the single engine's tokens."""

from __future__ import annotations

import ray

from tests.integration.conftest import GREEDY, cluster_config, oracle_tokens, random_prompts


def test_dead_decode_worker_is_routed_around(ray_session):
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 2)
    prompts = random_prompts(91, [6, 9, 12, 15, 18, 21, 90, 120])
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        ray.kill(cluster.workers["decode-1"], no_restart=True)
        results = cluster.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected
        assert all(r.decode_worker == "decode-0" for r in results)
        stats = cluster.stats()
        assert set(stats["workers"]) == {"prefill-0", "decode-0"}
        assert set(stats["router"]["loads"]) == {"prefill-0", "decode-0"}
        assert [r.token_ids for r in cluster.generate(prompts[:3], GREEDY)] == expected[:3]
