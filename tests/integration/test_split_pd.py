"""Prefill and decode workers both split over two ranks (``workers.tensor_parallel_size=2``,
``workers.num_prefill=1``) in a real Ray cluster: each decode rank reads its own shard of every
request's KV from the prefill worker's same rank (engine/rank_group.py, actors/rank_follower.py).
Greedy tokens equal one in-process single-rank engine's; the decode worker's rank 1 finished one
read per request, of exactly the blocks its rank 0 read."""

from __future__ import annotations

import ray

from tests.integration.conftest import GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for
from tests.integration.test_pd_hops import ALL_SPLIT


def test_split_prefill_and_decode_workers_serve_one_ranks_tokens(ray_session):
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 1, ALL_SPLIT, "workers.tensor_parallel_size=2")
    prompts = random_prompts(41, [40, 97])
    expected = oracle_tokens(cluster_config("tiny", 0, 1), prompts)
    with Cluster(config) as cluster:
        ranks = cluster._supervisor.ranks  # the test reads the groups the supervisor keeps
        assert set(ranks.followers) == {"prefill-0", "decode-0"}
        results = [cluster.generate([p], GREEDY)[0] for p in prompts]
        assert [r.token_ids for r in results] == expected
        assert all(r.disaggregated for r in results)
        decode = cluster.workers["decode-0"]
        transfer = ray.get(decode.stats.remote(), timeout=30)["transfer"]
        assert transfer["reads"] == len(prompts) and transfer["failures"] == 0 and transfer["blocks"] > 0
        follower = ranks.followers["decode-0"][0]
        status = ray.get(follower.status.remote(), timeout=30)
        assert status["error"] is None and status["reads"] == len(prompts), status
        assert status["read_blocks"] == transfer["blocks"], "rank 1 moved exactly the blocks rank 0 moved"
        prefill = cluster.workers["prefill-0"]
        wait_for(
            lambda: ray.get(prefill.stats.remote(), timeout=30)["held_for_transfer"] == 0,
            30,
            "the prefill worker released what it held for the reads",
        )
