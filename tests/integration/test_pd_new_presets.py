"""The P/D path over NIXL on the hybrid presets beyond the Llama/Gemma families: tiny Granite-4.0-H
(Mamba2 states + NoPE attention KV, MoE MLPs), tiny Nemotron-H (the same groups, plus MLP-only and
MoE layers that keep no cache) and tiny Qwen3-Next (Gated DeltaNet states + gated attention KV).
1 prefill + 1 decode worker give the single engine's greedy tokens, and a request sharing a prefix
is routed with the hit its worker then really has."""

from __future__ import annotations

import pytest

from tests.integration.conftest import (
    GREEDY,
    cluster_config,
    oracle_tokens,
    random_prompts,
    wait_for,
)

pytest.importorskip("nixl")


@pytest.mark.parametrize(
    ("preset", "seed"),
    [("tiny-granite-h", 61), ("tiny-nemotron-h", 61), ("tiny-qwen3-next", 91)],
)
def test_nixl_pd_matches_a_single_engine(ray_session, preset: str, seed: int):
    from cluster.api import Cluster

    # no work guard: placement must not depend on which requests ran before
    config = cluster_config(preset, 1, 1, "transfer.backend=nixl", "router.work_imbalance_ratio=0")
    prompts = random_prompts(seed, [3, 70, 120, 200])
    base = random_prompts(seed + 1, [130])[0]
    follow_up = base[:100] + random_prompts(seed + 2, [80])[0]
    expected = oracle_tokens(config, [*prompts, base, follow_up])
    with Cluster(config) as cluster:
        results = cluster.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected[: len(prompts)]
        assert sum(r.disaggregated for r in results) >= 2
        transfers = cluster.stats()["workers"]["decode-0"]["transfer"]
        assert transfers["reads"] >= 2 and transfers["failures"] == 0 and transfers["bytes"] > 0

        first = cluster.generate([base], GREEDY)[0]
        second = cluster.generate([follow_up], GREEDY)[0]
        assert [first.token_ids, second.token_ids] == expected[len(prompts) :]
        # the recurrent group (Mamba2 or Gated DeltaNet) has states only at prefill chunk ends
        # (every 64 tokens here)
        assert second.cached_tokens >= 64, second.cached_tokens
        assert second.predicted_hit == second.cached_tokens, (second.route_reason, second.predicted_hit)
        again = cluster.generate([base], GREEDY)[0]
        assert again.token_ids == first.token_ids
        assert again.predicted_hit == again.cached_tokens > 0, (again.route_reason, again.predicted_hit)

        def released() -> bool:
            workers = cluster.stats()["workers"].values()
            return all(w["free_blocks"] == w["num_blocks"] for w in workers)

        wait_for(released, 15, "the prefill worker to release its held blocks")
