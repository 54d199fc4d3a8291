"""The host-tier benchmark's runs (``benchmarks/tiered_bench.py``): one model, four
configurations on fresh clusters with the same prompts, and the plain memcpy its promote
bandwidth is compared with.

Configurations (``RUNS``): kvfleet's router with the host tier on every worker
(``kv_cache.offload``), kvfleet's router without it, the approximate prefix tree
(``prefix_tree``: it routes a prefix where it sent it before) with the host tier on, and round
robin with the host tier on. Sizing (``tier_sizing``): every worker gets the same device pool,
``device_blocks``, so the workload's prefix set is ``working_set_over_device`` times the device
KV of the prefill workers together (the blocks each prefix keeps by the coordinator's per-group
rules, ``kvfleet_testing.sizing.blocks_for``), but never less than its requests in flight plus
one cached prefix need (the ratio reached is reported); the host tier is ``host_over_device``
times one worker's device KV bytes.

Per run: ``benchmarks.support.cluster_runs.outcome``'s latency, throughput, hit and prediction
numbers (``hit_rate``: cached prompt tokens of the completions over prompt tokens;
``false_hit_share``: decisions whose predicted hit was more than the worker found), plus the
workers' hit tokens per tier over their queried tokens during the measured prompts
(``hit_rate_by_tier``; None while the engines do not split their hits per tier) and the host
tiers' totals (``cluster.tier_stats``), with ``promote_bytes_per_s``: bytes promoted over the
host-side seconds of the promote copies.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.support.cluster_runs import drive, outcome
from configs import ClusterConfig
from engine.sampling_params import SamplingParams
from kvfleet_testing.sizing import blocks_for, kv_groups, vocab_size
from kvfleet_testing.workloads import SharedPrefixWorkload, hit_rate_bound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    """One configuration: the router's policy and whether the workers have a host tier."""

    name: str
    policy: str
    host_tier: bool


RUNS = (
    RunSpec("kvfleet_tiered", "kvfleet", True),
    RunSpec("kvfleet_no_tier", "kvfleet", False),
    RunSpec("prefix_tree_tiered", "prefix_tree", True),
    RunSpec("round_robin_tiered", "round_robin", True),
)


@dataclass(frozen=True)
class TierSizing:
    """Per worker: device blocks (every pool), device KV bytes and the host tier's MiB."""

    device_blocks: int
    device_bytes: int
    host_mib: float
    prefix_set_blocks: int
    working_set_over_device: float


def tier_sizing(
    config: ClusterConfig, workload: SharedPrefixWorkload, working_set_over_device: float, host_over_device: float
) -> TierSizing:
    """The device pool that makes the prefix set ``working_set_over_device`` times the prefill
    workers' device KV (at least room for the requests in flight and one cached prefix), and a
    host tier ``host_over_device`` times it."""
    from engine.core import resolve_model_directory
    from engine.model.arch.hf_config import arch_from_hf_config
    from engine.model.checkpoints.loader import read_hf_config
    from engine.model.kv_layout import build_kv_layout

    groups = kv_groups(config)
    prefix_set = workload.num_prefixes * blocks_for(groups, workload.prefix_tokens)
    num_prefill = max(1, config.workers.num_prefill)
    in_flight = -(-workload.concurrency // num_prefill)
    prompt_tokens = workload.prefix_tokens + workload.suffix_tokens + workload.max_tokens
    floor = in_flight * blocks_for(groups, prompt_tokens) + blocks_for(groups, workload.prefix_tokens) + 1
    device_blocks = max(round(prefix_set / (working_set_over_device * num_prefill)), floor)
    arch = arch_from_hf_config(read_hf_config(resolve_model_directory(config)), config.model.sliding_window_override)
    layout = build_kv_layout(arch, config.kv_cache.block_size, config.model.resolved_dtype)
    device_bytes = layout.pool_bytes(device_blocks)
    return TierSizing(
        device_blocks=device_blocks,
        device_bytes=device_bytes,
        host_mib=round(host_over_device * device_bytes / 2**20, 3),
        prefix_set_blocks=prefix_set,
        working_set_over_device=round(prefix_set / (device_blocks * num_prefill), 3),
    )


def configured(config: ClusterConfig, sizing: TierSizing, spec: RunSpec) -> ClusterConfig:
    """``config`` with the run's policy, the sized device pool and the host tier on or off."""
    cache = config.kv_cache
    pinning = cache.pinning
    if pinning.budget_blocks is not None and pinning.budget_blocks > sizing.device_blocks:
        pinning = pinning.model_copy(update={"budget_blocks": sizing.device_blocks})
    offload = cache.offload.model_copy(
        update={"enabled": spec.host_tier, "size_mib": sizing.host_mib, "measure_memcpy": spec.host_tier}
    )
    kv = cache.model_copy(
        update={
            "num_blocks": sizing.device_blocks,
            "memory_budget_mib": None,
            "gpu_memory_utilization": None,
            "pinning": pinning,
            "offload": offload,
        }
    )
    router = config.router.model_copy(update={"policy": spec.policy, "pins": []})
    return config.model_copy(update={"kv_cache": kv, "router": router})


def run_one(config: ClusterConfig, spec: RunSpec, workload: SharedPrefixWorkload) -> dict[str, Any]:
    """One configuration on a fresh cluster: ``outcome``'s numbers, hit rate per tier and the
    host tiers' totals over the measured prompts."""
    from cluster.api import Cluster

    sampling = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True)
    with Cluster(config) as cluster:
        vocab = cluster.vocab_size
        cluster.generate(workload.warmup_prompts(vocab), sampling)  # first-step costs out of the numbers
        prompts = workload.prompts(vocab)
        before = cluster.stats()["totals"]
        results, elapsed = drive(cluster, prompts, sampling, workload.concurrency)
        after = cluster.stats()["totals"]
    out = outcome(results, elapsed)
    out.update(run=spec.name, policy=spec.policy, tiered=spec.host_tier, **tier_numbers(before, after))
    return out


def tier_numbers(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the workers' tiers did between two ``Cluster.stats()`` totals."""
    queried = after["queried_tokens"] - before["queried_tokens"]
    out: dict[str, Any] = {
        "worker_hit_rate": round((after["hit_tokens"] - before["hit_tokens"]) / queried, 4) if queried else 0.0
    }
    split_after, split_before = after.get("hit_tokens_by_tier"), before.get("hit_tokens_by_tier")
    if split_after is None or split_before is None or not queried:
        out["hit_rate_by_tier"] = None
    else:
        out["hit_rate_by_tier"] = {t: round((split_after[t] - split_before[t]) / queried, 4) for t in split_after}
    host_after, host_before = after.get("host_tier"), before.get("host_tier")
    if host_after is None or host_before is None:
        out["host_tier"] = None
        return out
    keys = (
        "offloaded_blocks",
        "refreshed_blocks",
        "dropped_blocks",
        "promoted_blocks",
        "bytes_offloaded",
        "bytes_promoted",
        "offload_seconds",
        "promote_seconds",
        "memcpy_bytes",
        "memcpy_seconds",
    )
    moved = {k: host_after.get(k, 0) - host_before.get(k, 0) for k in keys}
    moved["memcpy_seconds"] = round(moved["memcpy_seconds"], 6)
    moved["offload_seconds"] = round(moved["offload_seconds"], 4)
    moved["promote_seconds"] = round(moved["promote_seconds"], 4)
    moved["occupancy"] = round(host_after["occupancy"], 4)
    seconds = host_after["promote_seconds"] - host_before["promote_seconds"]
    moved["promote_bytes_per_s"] = round(moved["bytes_promoted"] / seconds) if seconds > 0 else None
    # the same bytes copied plainly by the same workers right after each promote batch
    memcpy_seconds = host_after.get("memcpy_seconds", 0) - host_before.get("memcpy_seconds", 0)
    moved["memcpy_bytes_per_s"] = round(moved["memcpy_bytes"] / memcpy_seconds) if memcpy_seconds > 0 else None
    out["host_tier"] = moved
    return out


def memcpy_bytes_per_s(num_bytes: int, repeats: int = 7) -> float:
    """A plain memcpy of ``num_bytes`` (one contiguous host buffer into another, numpy's copyto),
    the median of ``repeats`` timed copies after one untimed."""
    num_bytes = max(num_bytes, 1 << 20)
    src = np.random.default_rng(0).integers(0, 256, num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times)


def run_model(
    config: ClusterConfig,
    workload: SharedPrefixWorkload,
    working_set_over_device: float,
    host_over_device: float,
    runs: tuple[RunSpec, ...] = RUNS,
) -> dict[str, Any]:
    """Every configuration on one model: per-run numbers, the sizing, the prompt order's hit
    bound, and the promote bandwidth of the tiered kvfleet run over a memcpy of its bytes."""
    from engine.kv_cache.spec import alignment_tokens

    sizing = tier_sizing(config, workload, working_set_over_device, host_over_device)
    log.info("%s: %s", config.model.source, sizing)
    out: dict[str, Any] = {"sizing": vars(sizing).copy(), "runs": {}}
    for spec in runs:
        start = time.monotonic()
        out["runs"][spec.name] = run_one(configured(config, sizing, spec), spec, workload)
        log.info(
            "%s %s done in %.0f s: %s",
            config.model.source,
            spec.name,
            time.monotonic() - start,
            {k: v for k, v in out["runs"][spec.name].items() if k != "mispredictions"},
        )
    bound = hit_rate_bound(workload.prompts(vocab_size(config)), alignment_tokens(kv_groups(config)))
    out["hit_rate_bound"] = round(bound, 4)
    tiered = out["runs"].get("kvfleet_tiered", {}).get("host_tier") or {}
    promote = tiered.get("promote_bytes_per_s")
    if promote:
        memcpy = memcpy_bytes_per_s(int(tiered["bytes_promoted"]))
        out["promote"] = {
            "bytes": tiered["bytes_promoted"],
            "bytes_per_s": promote,
            "memcpy_bytes_per_s": round(memcpy),
            "over_memcpy": round(promote / memcpy, 4),
            "same_process_memcpy_bytes_per_s": tiered.get("memcpy_bytes_per_s"),
            "over_same_process_memcpy": (
                round(promote / tiered["memcpy_bytes_per_s"], 4) if tiered.get("memcpy_bytes_per_s") else None
            ),
        }
    else:
        out["promote"] = None
    return out
