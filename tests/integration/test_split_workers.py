"""Workers split over two ranks (``workers.tensor_parallel_size=2``) in a real Ray cluster: each is
a placement group with the worker actor as rank 0 and a ``RankFollower`` as rank 1
(cluster/rank_groups.py). Greedy tokens equal one in-process single-rank engine's; a follower
killed mid-stream takes its worker down as one unit (its requests migrate to the other worker
and every stream completes with one rank's tokens), the worker is replaced with a new group, and
it serves the same tokens again; a follower that dies under an idle worker is found by the
leader's keep-alive and its worker replaced too."""

from __future__ import annotations

import asyncio
import time

import ray

from engine.sampling_params import SamplingParams
from tests.integration.conftest import FAST_HEALTH, GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for
from tests.integration.test_failover import REPLACE_TIMEOUT_S, replaced, run_concurrently

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_split_workers_serve_one_ranks_tokens_and_a_dead_rank_takes_its_worker_down(ray_session):
    from cluster.api import Cluster

    single = cluster_config("tiny", 0, 2, *FAST_HEALTH)
    config = cluster_config("tiny", 0, 2, "workers.tensor_parallel_size=2", *FAST_HEALTH)
    prompts = random_prompts(37, [6, 12, 30, 90, 17, 44])
    expected = oracle_tokens(single, prompts)
    expected_long = oracle_tokens(single, prompts, LONG)
    with Cluster(config) as cluster:
        ranks = cluster._supervisor.ranks  # the test reads the groups the supervisor keeps
        assert set(ranks.followers) == {"decode-0", "decode-1"}
        assert all(len(followers) == 1 for followers in ranks.followers.values())
        results = cluster.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected
        assert {r.decode_worker for r in results} == {"decode-0", "decode-1"}
        statuses = ray.get([f.status.remote() for fs in ranks.followers.values() for f in fs], timeout=30)
        assert all(s["steps"] > 0 and s["error"] is None for s in statuses), statuses

        async def kill_mid_stream() -> list:
            runs = asyncio.ensure_future(run_concurrently(cluster, prompts, LONG))
            deadline = time.monotonic() + 60
            while (await cluster.workers["decode-0"].stats.remote())["requests"] == 0:  # streams running there
                assert time.monotonic() < deadline, "decode-0 never ran a request"
                await asyncio.sleep(0.01)
            ray.kill(ranks.followers["decode-0"][0], no_restart=True)
            return await runs

        outcomes = asyncio.run(kill_mid_stream())
        # every stream completes (those on decode-0 migrate, serve.migration_limit), with one rank's tokens
        assert [o.token_ids if not isinstance(o, BaseException) else repr(o) for o in outcomes] == expected_long
        assert cluster.replacements >= 1 or "decode-0" in cluster.lost, "the split worker went down as one"
        wait_for(lambda: replaced(cluster, "decode-0", 1), REPLACE_TIMEOUT_S, "decode-0 replaced")
        assert len(ranks.followers["decode-0"]) == 1, "the replacement is a new group of two ranks"
        again = cluster.generate(prompts * 2, GREEDY)
        assert [r.token_ids for r in again] == expected * 2
        assert "decode-0" in {r.decode_worker for r in again}
        replacements = cluster.replacements
        ray.kill(ranks.followers["decode-1"][0], no_restart=True)  # under an idle worker: its keep-alive finds it
        wait_for(lambda: replaced(cluster, "decode-1", replacements + 1), REPLACE_TIMEOUT_S, "idle decode-1 replaced")
