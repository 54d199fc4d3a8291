"""A workload against the cluster under each routing policy: kvfleet's hybrid-aware router,
an approximate prefix tree (``prefix_tree``) and round robin.

The shared-prefix workload (``Workload``): ``num_prefixes`` documents of ``prefix_tokens``
tokens, each asked ``requests_per_prefix`` questions of ``suffix_tokens`` tokens, in a shuffled
order, ``concurrency`` requests in flight; ``cluster.hybrid_workload.HybridWorkload`` is the
mix where exact hybrid prediction matters. Each policy runs on a fresh cluster of the same
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
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from configs import ClusterConfig
from engine.kv_cache.spec import alignment_tokens
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

POLICIES = ("kvfleet", "prefix_tree", "round_robin")


@dataclass(frozen=True)
class Workload:
    """The shared-prefix request mix (token-id prompts, so lengths are exact)."""

    num_prefixes: int = 8
    requests_per_prefix: int = 16
    prefix_tokens: int = 256
    suffix_tokens: int = 16
    max_tokens: int = 8
    concurrency: int = 4
    cache_fraction: float = 0.5
    warmup: int = 2
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        low, high = min(3, vocab_size - 1), vocab_size - 1
        prefixes = [[rng.randint(low, high) for _ in range(self.prefix_tokens)] for _ in range(self.num_prefixes)]
        prompts = [
            prefix + [rng.randint(low, high) for _ in range(self.suffix_tokens)]
            for prefix in prefixes
            for _ in range(self.requests_per_prefix)
        ]
        rng.shuffle(prompts)
        return prompts

    def warmup_prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed + 1)
        return [[rng.randint(3, vocab_size - 1) for _ in range(self.suffix_tokens + 4)] for _ in range(self.warmup)]


def blocks_for(groups: list[Any], num_tokens: int) -> int:
    """Blocks a cached prefix of ``num_tokens`` keeps in the pool across ``groups``: what a hit at
    its last whole block needs, by the coordinator's own per-group rules (full attention: every
    block; sliding window: the window's; Mamba: one state)."""
    from engine.routing import HitRules

    rules = HitRules(groups)
    total = 0
    for manager in rules.managers:
        aligned = max(num_tokens - num_tokens % manager.block_size, manager.block_size)
        needed = manager.blocks_needed_at(aligned)
        total += needed.stop - needed.start
    return total


def sized_config(config: ClusterConfig, workload: Workload, groups: list[Any]) -> ClusterConfig:
    """``config`` with every worker's pool sized to ``cache_fraction`` of the prefix set plus room
    for the requests in flight on one worker (``cache_fraction`` 0: the config's own size)."""
    if workload.cache_fraction <= 0:
        return config
    prompt_tokens = workload.prefix_tokens + workload.suffix_tokens + workload.max_tokens
    in_flight = -(-workload.concurrency // max(1, config.workers.num_prefill))
    prefix_set = workload.num_prefixes * blocks_for(groups, workload.prefix_tokens)
    num_blocks = int(workload.cache_fraction * prefix_set) + in_flight * blocks_for(groups, prompt_tokens) + 1
    pinning = config.kv_cache.pinning
    if pinning.budget_blocks is not None and pinning.budget_blocks > num_blocks:
        pinning = pinning.model_copy(update={"budget_blocks": num_blocks})
    kv = config.kv_cache.model_copy(update={"num_blocks": num_blocks, "memory_budget_mib": None, "pinning": pinning})
    return config.model_copy(update={"kv_cache": kv})


def kv_groups(config: ClusterConfig) -> list[Any]:
    """The KV-cache groups the config's workers will have (read from the model's config.json)."""
    from engine.core import resolve_model_directory
    from engine.model.arch import arch_from_hf_config
    from engine.model.kv_layout import build_kv_layout
    from engine.model.loader import read_hf_config

    hf_config = read_hf_config(resolve_model_directory(config))
    arch = arch_from_hf_config(hf_config, config.model.sliding_window_override)
    dtype = config.model.resolved_dtype
    return list(build_kv_layout(arch, config.kv_cache.block_size, dtype).groups)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return len(os.path.commonprefix([list(a), list(b)]))


def hit_rate_bound(prompts: list[list[int]], alignment: int) -> float:
    """The token hit rate no router can beat on ``prompts`` in this order: every request finds,
    in an unbounded cache, the longest prefix it shares with any earlier request (whole
    ``alignment``-token steps, at most its length - 1, as the engine looks up). The gap between a
    policy's hit rate and this bound is what cache capacity and placement cost it."""
    hit = total = 0
    seen: list[list[int]] = []
    for prompt in prompts:
        best = min(max((common_prefix_length(prompt, e) for e in seen), default=0), len(prompt) - 1)
        hit += best - best % alignment
        total += len(prompt)
        seen.append(prompt)
    return hit / total if total else 0.0


def vocab_size(config: ClusterConfig) -> int:
    """The vocabulary of the config's model (read from its config.json), which token-id
    workloads draw from as the cluster's ``vocab_size`` does."""
    from engine.core import resolve_model_directory
    from engine.model.loader import read_hf_config

    return int(read_hf_config(resolve_model_directory(config))["vocab_size"])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run_policy(config: ClusterConfig, policy: str, workload: Any) -> dict[str, Any]:
    """One policy on a fresh cluster: the workload's latency, throughput and hit numbers.
    ``workload``: a ``Workload`` or anything with its ``prompts`` / ``warmup_prompts`` /
    ``concurrency`` / ``max_tokens``."""
    from cluster.api import Cluster

    router = config.router.model_copy(update={"policy": policy, "pins": [], "auto_pin": config.router.auto_pin})
    cfg = config.model_copy(update={"router": router})
    sampling = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True)
    with Cluster(cfg) as cluster:
        vocab = cluster.vocab_size
        cluster.generate(workload.warmup_prompts(vocab), sampling)  # first-step costs out of the numbers
        prompts = workload.prompts(vocab)

        async def drive() -> list[Any]:
            gate = asyncio.Semaphore(workload.concurrency)

            async def one(prompt: list[int]) -> Any:
                async with gate:
                    return await cluster.agenerate(prompt, sampling)

            return list(await asyncio.gather(*(one(p) for p in prompts)))

        start = time.monotonic()
        results = asyncio.run(drive())
        elapsed = time.monotonic() - start
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
            {"reason": r.route_reason, "worker": r.prefill_worker, "decode": r.decode_worker,
             "prompt": len(r.prompt_token_ids), "predicted": r.predicted_hit, "found": r.cached_tokens}
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
    """Every policy in turn on ``config`` sized for ``workload`` (a ``Workload`` or a
    ``HybridWorkload``): the per-policy numbers, the ratios, and the prompt order's
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
