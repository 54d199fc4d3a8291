"""The cluster benchmark (``benchmarks/cluster_bench.py``) in one run: every routing policy
(kvfleet, prefix_tree, round_robin) on the shared-prefix workload and on the hybrid-pressure
workload (on the main model and on a second, Mamba hybrid preset), pins re-established by copy vs by
computing, and the P/D TTFT overhead (``benchmarks.pd_overhead``). Beside each hybrid workload's
runs, ``route_ceiling``: the same prompts replayed one at a time through the workers' real
coordinators under each placement and a perfect-knowledge oracle
(``benchmarks.support.route_replay``), i.e. how much hit rate placement alone can win there.

The result's ``summary`` holds exactly the issue's keys; everything else is the evidence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from benchmarks.support.cluster_runs import POLICIES, run_bench, run_policy
from configs import ClusterConfig
from kvfleet_testing.sizing import kv_groups, sized_config
from kvfleet_testing.workloads import HybridWorkload, SharedPrefixWorkload

log = logging.getLogger(__name__)

SUMMARY_KEYS = (
    "p90_ttft_ratio_vs_round_robin",
    "p90_ttft_ratio_vs_prefix_tree",
    "hit_rate_ratio_vs_prefix_tree",
    "hybrid_p90_ttft_ratio_vs_prefix_tree",
    "hybrid_hit_rate_ratio_vs_prefix_tree",
    "false_hit_share",
    "pd_ttft_overhead_ratio",
    "repin_transfer_over_recompute",
)


@dataclass(frozen=True)
class Suite:
    """What one benchmark run covers (``hybrid_configs``: name -> config of the hybrid workload
    runs, the main model first; ``repin_tokens`` 0 skips the pin measurement)."""

    shared: SharedPrefixWorkload = field(default_factory=SharedPrefixWorkload)
    hybrid: HybridWorkload = field(default_factory=HybridWorkload)
    hybrid_small: HybridWorkload = field(default_factory=HybridWorkload)
    policies: tuple[str, ...] = POLICIES
    repin_tokens: int = 512
    repin_trials: int = 4
    auto_pin_compare: bool = True


def compare_decode_auto_pins(config: ClusterConfig, workload: Any) -> dict[str, Any]:
    """kvfleet with automatic pins on the prefill workers only, then also on the decode workers
    (``auto_pin.on_decode_workers``), same P/D config and prompts; ``wins`` when the decode pins
    lower the p90 TTFT without lowering the hit rate or the throughput."""
    sized = sized_config(config, workload, kv_groups(config))
    runs = {}
    for name, on_decode in (("prefill_only", False), ("with_decode", True)):
        auto = sized.router.auto_pin.model_copy(update={"enabled": True, "on_decode_workers": on_decode})
        cfg = sized.model_copy(update={"router": sized.router.model_copy(update={"auto_pin": auto})})
        runs[name] = run_policy(cfg, "kvfleet", workload)
        log.info("auto pins %s: %s", name, runs[name])
    base, new = runs["prefill_only"], runs["with_decode"]
    wins = (
        new["ttft_p90_s"] < base["ttft_p90_s"]
        and new["hit_rate"] >= base["hit_rate"]
        and new["output_tokens_per_s"] >= base["output_tokens_per_s"]
    )
    keys = ("ttft_p50_s", "ttft_p90_s", "hit_rate", "output_tokens_per_s", "mispredicted_share", "false_hit_share")
    return {"runs": {n: {k: r[k] for k in keys} for n, r in runs.items()}, "wins": wins}


def pd_overhead(config: ClusterConfig) -> dict[str, Any]:
    """``pd_ttft_overhead_ratio`` (and its per-hop evidence) from
    ``benchmarks.pd_overhead.measure_pd_overhead``."""
    from benchmarks.pd_overhead import measure_pd_overhead

    result = measure_pd_overhead(config)
    return {
        "pd_ttft_overhead_ratio": result.get("pd_ttft_overhead_ratio"),
        "source": "benchmarks.pd_overhead.measure_pd_overhead",
        "detail": result,
    }


def run_suite(main: ClusterConfig, hybrid_second: ClusterConfig | None, suite: Suite) -> dict[str, Any]:
    """The whole benchmark; ``summary`` carries the issue's keys (None where not measured)."""
    from benchmarks.support.repin import measure_repin
    from benchmarks.support.route_replay import route_ceiling

    out: dict[str, Any] = {}
    out["shared_prefix"] = run_bench(main, suite.shared, suite.policies)
    out["hybrid"] = {main.model.source: run_bench(main, suite.hybrid, suite.policies)}
    out["hybrid"][main.model.source]["route_ceiling"] = route_ceiling(main, suite.hybrid)
    if hybrid_second is not None:
        second = run_bench(hybrid_second, suite.hybrid_small, suite.policies)
        second["route_ceiling"] = route_ceiling(hybrid_second, suite.hybrid_small)
        out["hybrid"][hybrid_second.model.source] = second
    if suite.auto_pin_compare:
        out["auto_pin_decode"] = compare_decode_auto_pins(main, suite.hybrid)
    if suite.repin_tokens > 0:
        out["repin"] = measure_repin(main, suite.repin_tokens, suite.repin_trials)
    out["pd_overhead"] = pd_overhead(main)
    out["summary"] = issue_summary(out, main.model.source)
    return out


def issue_summary(out: dict[str, Any], main_model: str) -> dict[str, Any]:
    """The issue's keys from the runs: shared-prefix ratios, hybrid ratios on the main model,
    the repin and P/D ratios, and ``false_hit_share``: the share of routing decisions (every
    workload's runs pooled, per policy) that predicted more cached tokens than the worker found
    (a false hit). Beside them, ``mispredicted_share``: predictions off in either direction
    (kvfleet's under-predictions are prefixes routed while still in flight to that worker,
    cached by the time the request was admitted)."""
    shared = out["shared_prefix"]
    hybrid = out["hybrid"].get(main_model, {})
    rows: dict[str, list[tuple[float, float, int]]] = {}
    for result in [shared, *out["hybrid"].values()]:
        for policy, run in result["runs"].items():
            rows.setdefault(policy, []).append((run["false_hit_share"], run["mispredicted_share"], run["requests"]))

    def pooled(policy: str, column: int) -> float | None:
        got = rows.get(policy)
        if not got:
            return None
        return round(sum(r[column] * r[2] for r in got) / max(1, sum(r[2] for r in got)), 4)

    return {
        "p90_ttft_ratio_vs_round_robin": shared.get("p90_ttft_ratio_vs_round_robin"),
        "p90_ttft_ratio_vs_prefix_tree": shared.get("p90_ttft_ratio_vs_prefix_tree"),
        "hit_rate_ratio_vs_prefix_tree": shared.get("hit_rate_ratio_vs_prefix_tree"),
        "hybrid_p90_ttft_ratio_vs_prefix_tree": hybrid.get("p90_ttft_ratio_vs_prefix_tree"),
        "hybrid_hit_rate_ratio_vs_prefix_tree": hybrid.get("hit_rate_ratio_vs_prefix_tree"),
        "false_hit_share": {"kvfleet": pooled("kvfleet", 0), "prefix_tree": pooled("prefix_tree", 0)},
        "pd_ttft_overhead_ratio": out["pd_overhead"]["pd_ttft_overhead_ratio"],
        "repin_transfer_over_recompute": out.get("repin", {}).get("repin_transfer_over_recompute"),
        "mispredicted_share": {"kvfleet": pooled("kvfleet", 1), "prefix_tree": pooled("prefix_tree", 1)},
    }
