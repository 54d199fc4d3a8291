"""How much token hit rate placement alone can win over an approximate prefix tree on hybrid
models, across a grid of hybrid-pressure workloads: whether any router can reach the cluster
benchmark's target ``hybrid_hit_rate_ratio_vs_prefix_tree`` >= 1.2 (benchmarks/cluster_bench.py).

Each grid point is ``kvfleet_testing.workloads.HybridWorkload`` with one setting of
``cache_fraction`` (pool size: that share of the prefix set plus the requests in flight),
``zipf`` (popularity skew), ``num_prefixes`` and ``flood_share`` (unique prompts pushing cached
blocks out); every other field as in benchmarks/cluster_bench.py's hybrid workload for that
model. At each point ``benchmarks.support.route_replay.replay`` runs the prompts one at a time through two
real coordinators built like the workers (groups, pool, retention tier) under the approximate
tree (``prefix_tree``), kvfleet's policy (``kvfleet``) and a perfect-knowledge oracle
(``exact_oracle``: the worker whose coordinator holds the longest hit right now). No cluster, no
timing: only what each placement does to the caches.

    python -m benchmarks.route_ceiling                        # Gemma-3-270M and tiny Bamba, ~1 min
    python -m benchmarks.route_ceiling --configs tiny-hybrid

Last line: ``{"oracle_over_prefix_tree": {model: {"min", "median", "max", "share_at_least_1_2"}},
"kvfleet_over_prefix_tree": {...}, "points": n}``.

Measured 2026-11-25 (81 points per model, 2 workers): Gemma-3-270M oracle / tree min 0.784,
median 1.009, max 1.211 (2 of 81 points >= 1.2); kvfleet / tree median 1.015, max 1.299
(5 of 81). Tiny Bamba: oracle / tree median 1.008, max 1.12 (0 of 81); kvfleet / tree median
1.016, max 1.13. A tree that never forgets where it sent a prefix keeps each prefix on one
worker; where that worker lost the prefix's window or state, no other worker has it either, so
its false hits cost it almost no hits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
from dataclasses import replace
from typing import Any

from benchmarks.support.route_replay import Replay
from configs import load_config
from kvfleet_testing.workloads import HybridWorkload

log = logging.getLogger("route_ceiling")

#: the hybrid workloads of benchmarks/cluster_bench.py per preset (the grid varies the rest)
BASES = {
    "local": HybridWorkload(num_prefixes=12, num_requests=144, prefix_tokens=640, sweep_tokens=32),
    "tiny-hybrid": HybridWorkload(num_prefixes=16, num_requests=96, prefix_tokens=192, sweep_tokens=16),
}
GRID = {
    "cache_fraction": (0.15, 0.35, 0.6),
    "zipf": (0.6, 1.0, 1.4),
    "num_prefixes": (6, 12, 24),
    "flood_share": (0.0, 0.15, 0.3),
}
PLACEMENTS = ("prefix_tree", "kvfleet", "exact_oracle")


def summarise(ratios: list[float]) -> dict[str, float]:
    ordered = sorted(ratios)
    return {
        "min": round(ordered[0], 3),
        "median": round(statistics.median(ordered), 3),
        "max": round(ordered[-1], 3),
        "share_at_least_1_2": round(sum(r >= 1.2 for r in ordered) / len(ordered), 3),
    }


def grid(preset: str, workers: int) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    config = load_config(preset, [f"workers.num_prefill={workers}", "workers.num_decode=2"])
    base = BASES.get(preset, BASES["tiny-hybrid"])
    rows = []
    for values in itertools.product(*GRID.values()):
        point = dict(zip(GRID, values, strict=False))
        workload = replace(base, **point)
        prepared = Replay(config, workload)
        hits = {p: prepared.run(p, workers)["hit_rate"] for p in PLACEMENTS}
        rows.append({**point, **hits})
        log.info("%s %s: %s", preset, point, hits)
    usable = [r for r in rows if r["prefix_tree"] > 0]
    return rows, {name: summarise([r[name] / r["prefix_tree"] for r in usable]) for name in ("exact_oracle", "kvfleet")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="local,tiny-hybrid", help="presets, comma-separated")
    parser.add_argument("--workers", type=int, default=2, help="prefill workers (placement targets)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    oracle, ours, points = {}, {}, 0
    for preset in (p.strip() for p in args.configs.split(",") if p.strip()):
        rows, summary = grid(preset, args.workers)
        points = len(rows)
        print(json.dumps({"model": preset, "points": rows}))
        oracle[preset], ours[preset] = summary["exact_oracle"], summary["kvfleet"]
    print(json.dumps({"oracle_over_prefix_tree": oracle, "kvfleet_over_prefix_tree": ours, "points": points}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
