"""A workload against the cluster under each routing policy: kvfleet's hybrid-aware router,
an approximate prefix tree (``prefix_tree``) and round robin.

The workloads are ``kvfleet_testing.workloads.SharedPrefixWorkload`` (``num_prefixes`` documents
of ``prefix_tokens`` tokens, each asked ``requests_per_prefix`` questions of ``suffix_tokens``
tokens, in a shuffled order, ``concurrency`` requests in flight) and ``HybridWorkload`` (the mix
where exact hybrid prediction matters). Each policy runs on a fresh cluster of the same
config (same workers, same cache sizes, same prompts) so none inherits another's cache. Each
worker's pool holds ``cache_fraction`` of the whole prefix set plus room for its requests in
flight (``cache_fraction`` 0 keeps the config's size): a router that keeps each prefix on one
worker fits its share, one that spreads every prefix over every worker evicts.

Reported per policy: TTFT p50/p90 (driver side), output tokens/s, token hit rate (prompt tokens
found cached on the worker that prefilled, over prompt tokens), ``mispredicted_share``: routing
decisions whose predicted hit (``ClusterCompletion.predicted_hit``: kvfleet's exact prediction,
the prefix tree's own belief, round robin's 0) differs from the hit the worker found
(``cached_tokens``), ``false_hit_share``: those predicting more than was found, and the per-hop
TTFT breakdown when completions carry one (``hops``). ``summary`` gives the ratios of kvfleet
to each baseline.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from typing import Any

from benchmarks.support.stats import percentile
from configs import ClusterConfig
from engine.kv_cache.spec import alignment_tokens
from engine.sampling_params import SamplingParams
from kvfleet_testing.sizing import kv_groups, sized_config, vocab_size
from kvfleet_testing.workloads import hit_rate_bound

log = logging.getLogger(__name__)

POLICIES = ("kvfleet", "prefix_tree", "round_robin")


def drive(
    cluster: Any, prompts: list[list[int]], sampling: SamplingParams, concurrency: int
) -> tuple[list[Any], float]:
    """Every prompt through ``cluster`` (a started ``Cluster``), ``concurrency`` in flight: the
    completions in prompt order and the seconds they took."""

    async def all_of() -> list[Any]:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int]) -> Any:
            async with gate:
                return await cluster.agenerate(prompt, sampling)

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    start = time.monotonic()
    results = asyncio.run(all_of())
    return results, time.monotonic() - start


def run_policy(config: ClusterConfig, policy: str, workload: Any) -> dict[str, Any]:
    """One policy on a fresh cluster: the workload's latency, throughput and hit numbers.
    ``workload``: a ``SharedPrefixWorkload`` or anything with its ``prompts`` / ``warmup_prompts`` /
    ``concurrency`` / ``max_tokens``."""
    from cluster.api import Cluster

    router = config.router.model_copy(update={"policy": policy, "pins": [], "auto_pin": config.router.auto_pin})
    cfg = config.model_copy(update={"router": router})
    sampling = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True)
    with Cluster(cfg) as cluster:
        vocab = cluster.vocab_size
        cluster.generate(workload.warmup_prompts(vocab), sampling)  # first-step costs out of the numbers
        results, elapsed = drive(cluster, workload.prompts(vocab), sampling, workload.concurrency)
        stats = cluster.stats()
    out = outcome(results, elapsed)
    out.update(
        policy=policy,
        num_blocks_per_worker=cfg.kv_cache.num_blocks,
        worker_hit_rates={w: round(s["hit_rate"], 4) for w, s in stats["workers"].items()},
        route_reasons=stats.get("router", {}).get("reasons", {}),
    )
    return out


def outcome(results: list[Any], elapsed: float) -> dict[str, Any]:
    """Latency, throughput, hit and prediction numbers of finished ``ClusterCompletion``s."""
    ttfts = [r.ttft_s for r in results]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
    output_tokens = sum(len(r.token_ids) for r in results)
    cached = sum(min(r.cached_tokens, len(r.prompt_token_ids)) for r in results)
    wrong = sum(r.predicted_hit != r.cached_tokens for r in results)
    over = sum(r.predicted_hit > r.cached_tokens for r in results)
    count = len(results)
    return {
        "requests": count,
        "seconds": round(elapsed, 3),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else 0.0,
        "output_tokens_per_s": round(output_tokens / elapsed, 2) if elapsed > 0 else 0.0,
        "hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
        "mispredicted_share": round(wrong / count, 4) if count else 0.0,
        "false_hit_share": round(over / count, 4) if count else 0.0,
        "false_hit_tokens": sum(max(0, r.predicted_hit - r.cached_tokens) for r in results),
        "disaggregated": sum(r.disaggregated for r in results),
        "hops": hop_summary(results),
        "mispredictions": [
            {
                "reason": r.route_reason,
                "worker": r.prefill_worker,
                "decode": r.decode_worker,
                "prompt": len(r.prompt_token_ids),
                "predicted": r.predicted_hit,
                "found": r.cached_tokens,
            }
            for r in results
            if r.predicted_hit != r.cached_tokens
        ][:12],
    }


def hop_summary(results: list[Any]) -> dict[str, dict[str, float]] | None:
    """p50/p90 seconds of every TTFT hop the completions carry (``hops``: hop name -> seconds,
    or an object with such fields); None when they carry none."""
    per_hop: dict[str, list[float]] = {}
    for r in results:
        hops = getattr(r, "hops", None)
        if hops is None:
            continue
        items = hops.items() if isinstance(hops, dict) else vars(hops).items() if hasattr(hops, "__dict__") else ()
        if not items and hasattr(hops, "__dataclass_fields__"):
            items = [(name, getattr(hops, name)) for name in hops.__dataclass_fields__]
        for name, value in items:
            if isinstance(value, (int, float)) and value is not None:
                per_hop.setdefault(name, []).append(float(value))
    if not per_hop:
        return None
    return {
        name: {"p50_s": round(percentile(v, 0.5), 4), "p90_s": round(percentile(v, 0.9), 4)}
        for name, v in per_hop.items()
    }


def run_bench(config: ClusterConfig, workload: Any, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """Every policy in turn on ``config`` sized for ``workload`` (a ``SharedPrefixWorkload``
    or a ``HybridWorkload``): the per-policy numbers, the ratios, and the prompt order's
    ``hit_rate_bound``."""
    groups = kv_groups(config)
    sized = sized_config(config, workload, groups)
    runs = {}
    for policy in policies:
        start = time.monotonic()
        runs[policy] = run_policy(sized, policy, workload)
        log.info("%s done in %.0f s: %s", policy, time.monotonic() - start, runs[policy])
    bound = hit_rate_bound(workload.prompts(vocab_size(config)), alignment_tokens(groups))
    return {"runs": runs, "hit_rate_bound": round(bound, 4), **summary(runs)}


def summary(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios of kvfleet to each baseline run (None where the baseline's value is 0), and the
    per-policy numbers they come from."""
    out: dict[str, Any] = {"tokens_per_s": {p: r["output_tokens_per_s"] for p, r in runs.items()}}
    out["ttft_p50_s"] = {p: r["ttft_p50_s"] for p, r in runs.items()}
    out["ttft_p90_s"] = {p: r["ttft_p90_s"] for p, r in runs.items()}
    out["hit_rate"] = {p: r["hit_rate"] for p, r in runs.items()}
    out["mispredicted_share"] = {p: r["mispredicted_share"] for p, r in runs.items()}
    ours = runs.get("kvfleet")
    if ours is None:
        return out
    for base_name in ("round_robin", "prefix_tree"):
        base = runs.get(base_name)
        if base is None:
            continue
        out[f"p90_ttft_ratio_vs_{base_name}"] = _ratio(ours["ttft_p90_s"], base["ttft_p90_s"])
        out[f"hit_rate_ratio_vs_{base_name}"] = _ratio(ours["hit_rate"], base["hit_rate"])
        out[f"tokens_per_s_ratio_vs_{base_name}"] = _ratio(ours["output_tokens_per_s"], base["output_tokens_per_s"])
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None
