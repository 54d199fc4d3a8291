"""Cluster benchmark (issue 16): kvfleet's hybrid-aware router against an approximate prefix tree
and round robin, on 2 prefill + 2 decode workers, fresh cluster per policy, same prompts and
concurrency (the logic lives in ``cluster.bench``, ``cluster.hybrid_workload``,
``cluster.repin_bench`` and ``cluster.bench_suite``).

    python benchmarks/cluster_bench.py                     # Gemma-3-270M + tiny Bamba (~20 min here)
    python benchmarks/cluster_bench.py --quick             # small counts, for development
    python benchmarks/cluster_bench.py --config tiny --hybrid-config tiny-hybrid

Runs: the shared-prefix workload and the hybrid-pressure workload on ``--config`` (default: the
local preset, Gemma-3-270M: sliding window + full attention), the hybrid workload on
``--hybrid-config`` (default: tiny Bamba, Mamba2 + attention), each under every policy; pins
re-established by copy vs by compute on ``--config``; the P/D TTFT overhead where
``cluster.pd_overhead`` exists. Prints one JSON object per run and section, then the issue's
keys as the last line::

    {"p90_ttft_ratio_vs_round_robin": r, "p90_ttft_ratio_vs_prefix_tree": r,
     "hit_rate_ratio_vs_prefix_tree": r, "hybrid_p90_ttft_ratio_vs_prefix_tree": r,
     "hybrid_hit_rate_ratio_vs_prefix_tree": r, "false_hit_share": {"kvfleet": x, "prefix_tree": y},
     "pd_ttft_overhead_ratio": r, "repin_transfer_over_recompute": r}

``false_hit_share``: the share of routing decisions whose predicted hit was more than the hit the
worker found (a false hit), pooled over every workload (for the prefix tree, its own belief);
the summary section beside it gives ``mispredicted_share`` (off in either direction).

Measured numbers are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.bench import POLICIES, Workload  # noqa: E402
from cluster.bench_suite import SUMMARY_KEYS, Suite, run_suite  # noqa: E402
from cluster.hybrid_workload import HybridWorkload  # noqa: E402
from configs import load_config  # noqa: E402

log = logging.getLogger("cluster_bench")

BENCH_WORKERS = ["workers.num_prefill=2", "workers.num_decode=2"]


def build_suite(quick: bool, policies: tuple[str, ...]) -> Suite:
    if quick:
        return Suite(
            shared=Workload(num_prefixes=4, requests_per_prefix=6, prefix_tokens=128),
            hybrid=HybridWorkload(num_prefixes=6, num_requests=16, prefix_tokens=640, sweep_tokens=32),
            hybrid_small=HybridWorkload(num_prefixes=8, num_requests=32, prefix_tokens=96, sweep_tokens=8),
            policies=policies,
            repin_tokens=256,
            repin_trials=2,
            auto_pin_compare=False,
        )
    return Suite(
        shared=Workload(),
        # Gemma-3-270M's window is 512 tokens: prefixes past it, so a window can go while the
        # full-attention blocks before it stay
        hybrid=HybridWorkload(num_prefixes=12, num_requests=48, prefix_tokens=640, sweep_tokens=32),
        # tiny Bamba (4-token blocks, Mamba states checkpointed per 64-token prefill chunk)
        hybrid_small=HybridWorkload(num_prefixes=16, num_requests=96, prefix_tokens=192, sweep_tokens=16),
        policies=policies,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="local", help="main preset or YAML (default: local, Gemma-3-270M)")
    parser.add_argument("--hybrid-config", default="tiny-hybrid", help="second hybrid preset ('' to skip)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="dotted override (both)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--quick", action="store_true", help="small counts (development)")
    parser.add_argument("--no-auto-pin-compare", action="store_true", help="skip the decode auto-pin runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main_cfg = load_config(args.config, [*BENCH_WORKERS, *args.overrides])
    second = load_config(args.hybrid_config, [*BENCH_WORKERS, *args.overrides]) if args.hybrid_config else None
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    suite = build_suite(args.quick, policies)
    if args.no_auto_pin_compare:
        suite = replace(suite, auto_pin_compare=False)
    result = run_suite(main_cfg, second, suite)
    for name, run in result["shared_prefix"]["runs"].items():
        print(json.dumps({"workload": "shared_prefix", "model": main_cfg.model.source, **run}))
    for model, hybrid in result["hybrid"].items():
        for name, run in hybrid["runs"].items():
            print(json.dumps({"workload": "hybrid", "model": model, **run}))
    for key in ("shared_prefix",):
        print(json.dumps({"section": key, **{k: v for k, v in result[key].items() if k != "runs"}}))
    for model, hybrid in result["hybrid"].items():
        print(json.dumps({"section": "hybrid", "model": model, **{k: v for k, v in hybrid.items() if k != "runs"}}))
    if "auto_pin_decode" in result:
        print(json.dumps({"section": "auto_pin_decode", **result["auto_pin_decode"]}))
    if "repin" in result:
        print(json.dumps({"section": "repin", **result["repin"]}))
    print(json.dumps({"section": "pd_overhead", **result["pd_overhead"]}))
    summary = result["summary"]
    print(json.dumps({"section": "summary", **summary}))
    print(json.dumps({key: summary[key] for key in SUMMARY_KEYS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
