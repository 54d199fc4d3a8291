"""The P/D path over NIXL (UCX on loopback, DRAM to DRAM) instead of the in-process backend:
1 prefill + 1 decode worker on tiny Bamba give the single engine's greedy tokens."""

from __future__ import annotations

import pytest

from tests.integration.conftest import GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for

pytest.importorskip("nixl")


def test_nixl_pd_matches_a_single_engine(ray_session):
    from cluster.api import Cluster

    config = cluster_config("tiny-hybrid", 1, 1, "transfer.backend=nixl")
    prompts = random_prompts(81, [3, 70, 120, 200])
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        results = cluster.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected
        assert sum(r.disaggregated for r in results) >= 3
        transfers = cluster.stats()["workers"]["decode-0"]["transfer"]
        assert transfers["reads"] >= 3 and transfers["failures"] == 0 and transfers["bytes"] > 0

        def released() -> bool:
            workers = cluster.stats()["workers"].values()
            return all(w["free_blocks"] == w["num_blocks"] for w in workers)

        wait_for(released, 15, "the prefill worker to release its held blocks")
