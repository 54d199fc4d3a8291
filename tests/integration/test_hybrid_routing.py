"""kvfleet's router predicts, for every request of the hybrid-pressure workload, exactly the hit
the worker that prefilled it found (tiny Bamba: Mamba2 + attention; tiny Gemma3: sliding window +
full attention), on a real cluster with pools too small for the prefix set.

Oracle: each worker's own reported hit (``ClusterCompletion.cached_tokens``). Non-vacuity: the
workload must produce hits, and requests whose hit is below what an approximate router would
believe (the longest aligned prefix shared with an earlier prompt run on the same worker) — the
false hits an approximate prefix tree makes and kvfleet must not.
"""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from kvfleet_testing.workloads import HybridWorkload, common_prefix_length
from tests.integration.conftest import cluster_config

WORKLOAD = HybridWorkload(
    num_prefixes=6,
    num_requests=40,
    prefix_tokens=96,
    suffix_tokens=8,
    sweep_tokens=8,
    flood_share=0.2,
    max_tokens=2,
    concurrency=1,  # one at a time: no other request can change a cache between route and admission
    cache_fraction=0.5,
    seed=3,
)


def _believed(prompt: tuple[int, ...], earlier: list[tuple[int, ...]], alignment: int) -> int:
    """What a router that remembers where it sent prompts believes is cached: the longest
    common prefix with an earlier prompt on that worker, aligned, below the prompt's last token."""
    best = max((common_prefix_length(prompt, other) for other in earlier), default=0)
    best = min(best, len(prompt) - 2)
    return max(0, best - best % alignment)


@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny"])
def test_predicted_hit_equals_actual_hit_for_every_request(ray_session, preset):
    from cluster.api import Cluster
    from engine.kv_cache.spec import alignment_tokens
    from kvfleet_testing.sizing import kv_groups, sized_config

    # every request prefilled on a prefill worker (none short enough to run on the decode one)
    base = cluster_config(preset, 2, 1, "router.policy=kvfleet", "router.decode_only_threshold_tokens=0")
    groups = kv_groups(base)
    config = sized_config(base, WORKLOAD, groups)
    alignment = alignment_tokens(groups)
    sampling = SamplingParams(max_tokens=WORKLOAD.max_tokens, ignore_eos=True)
    with Cluster(config) as cluster:
        prompts = WORKLOAD.prompts(cluster.vocab_size)
        results = [cluster.generate([prompt], sampling)[0] for prompt in prompts]
    wrong = [
        (r.request_id, r.prefill_worker, r.route_reason, r.predicted_hit, r.cached_tokens)
        for r in results
        if r.predicted_hit != r.cached_tokens
    ]
    assert not wrong, f"{len(wrong)} of {len(results)} mispredicted: {wrong}"

    assert sum(r.cached_tokens > 0 for r in results) >= len(results) // 4, "the workload must produce hits"
    history: dict[str, list[tuple[int, ...]]] = {}
    below_belief = 0
    for r in results:
        seen = history.setdefault(r.prefill_worker, [])
        below_belief += r.cached_tokens < _believed(r.prompt_token_ids, seen, alignment)
        seen.append(r.prompt_token_ids)
    assert below_belief > 0, "no request whose hit was below an approximate router's belief: no pressure"


@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny"])
def test_concurrent_requests_never_run_below_their_predicted_hit(ray_session, preset):
    """With requests in flight together, a request's blocks can be evicted between its route and
    its admission (the requests queued ahead allocate; the router hears of an eviction a report
    later). The worker holds a predicted hit from arrival to admission (``HitLeases``) and sends
    back a request whose hit went before it arrived (``STALE_PREDICTION``), so no request runs
    below the hit its decision predicted (a request may find more: blocks a concurrent one
    computed after its route)."""
    import asyncio
    from dataclasses import replace

    from cluster.api import Cluster
    from kvfleet_testing.sizing import kv_groups, sized_config

    workload = replace(WORKLOAD, concurrency=4, num_requests=48)
    base = cluster_config(preset, 2, 1, "router.policy=kvfleet", "router.decode_only_threshold_tokens=0")
    config = sized_config(base, workload, kv_groups(base))
    sampling = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True)

    async def run_all(cluster, prompts):
        gate = asyncio.Semaphore(workload.concurrency)

        async def one(prompt):
            async with gate:
                return await cluster.agenerate(prompt, sampling)

        return await asyncio.gather(*(one(p) for p in prompts))

    with Cluster(config) as cluster:
        results = asyncio.run(run_all(cluster, workload.prompts(cluster.vocab_size)))
    false_hits = [
        (r.request_id, r.prefill_worker, r.route_reason, r.predicted_hit, r.cached_tokens)
        for r in results
        if r.predicted_hit > r.cached_tokens
    ]
    assert not false_hits, f"{len(false_hits)} of {len(results)} ran below their predicted hit: {false_hits}"
    assert sum(r.cached_tokens > 0 for r in results) >= len(results) // 4, "the workload must produce hits"
