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

Measured on this project's machine (2 shared cores, loaded by other agents' clusters; Gemma-3-270M
fp32, NIXL over loopback, 2P+2D; full run 25 minutes, 2026-11-25)::

    shared prefix  kvfleet      p50 0.80 s  p90 1.67 s  8.0 tok/s  hit 0.875  false hits 0.8%
                   prefix_tree  p50 0.85 s  p90 1.65 s  9.0 tok/s  hit 0.882  false hits 0.8%
                   round_robin  p50 1.36 s  p90 2.77 s  9.3 tok/s  hit 0.545
    hybrid Gemma   kvfleet      p50 4.00 s  p90 8.51 s  4.8 tok/s  hit 0.530  false hits 0
                   prefix_tree  p50 4.54 s  p90 9.53 s  4.1 tok/s  hit 0.530  false hits 0
                   round_robin  p50 7.22 s  p90 11.7 s  3.5 tok/s  hit 0.298
    hybrid Bamba   kvfleet      p50 70 ms   p90 110 ms  233 tok/s  hit 0.383  false hits 0
                   prefix_tree  p50 64 ms   p90 101 ms  274 tok/s  hit 0.364  false hits 69%
                   round_robin  p50 63 ms   p90 101 ms  275 tok/s  hit 0.287
    repin (512 tokens): compute 1.65 s, copy 0.108 s (p50 of 4), first contact 0.12-0.20 s
    decode auto pins: p90 9.74 s vs 8.09 s with prefill-only auto pins: no win, presets unchanged

    {"p90_ttft_ratio_vs_round_robin": 0.6045, "p90_ttft_ratio_vs_prefix_tree": 1.0132,
     "hit_rate_ratio_vs_prefix_tree": 0.9916, "hybrid_p90_ttft_ratio_vs_prefix_tree": 0.8929,
     "hybrid_hit_rate_ratio_vs_prefix_tree": 1.0, "false_hit_share": {"kvfleet": 0.0037,
     "prefix_tree": 0.2463}, "pd_ttft_overhead_ratio": 1.0237, "repin_transfer_over_recompute": 0.0653}

kvfleet's remaining mispredictions (2.6% pooled) are nearly all under-predictions: a prefix
routed to a worker while an earlier request for it was still in flight there (the router
steers by it, ``reason="inflight"``, but predicts only what the worker reported), cached by the
time the request was admitted. Its one false hit in 272 decisions was a decode-only request
whose decode worker had evicted the prefix between its last report and the routing. On the
shared-prefix workload kvfleet serves 89 of 128 requests decode-only (the decode workers hold the
pulled prefixes), so its p90 against the prefix tree is a tie, and the loaded machine (output
tok/s half of the earlier runs' 17) narrows the gap to round robin (0.60; 0.27-0.37 earlier).
On Gemma the hybrid workload at ``cache_fraction`` 0.35 never evicted a window under a prefix
the tree routed by (the tree made no false hit there either), so both hit alike.

The same hybrid workload on Gemma with pools at ``cache_fraction`` 0.15 (765 blocks per worker;
``cluster.bench_suite.run_workload``, 48 requests, one run each), before and after the worker
reported each step's evictions right after scheduling and kept the predicted hit evict-last
(commit 8998020; the full run above predates it):

    before  kvfleet p90 8.44 s hit 0.353 false hits 14.6%   prefix_tree p90 7.41 s hit 0.401 false hits 31.3%
    after   kvfleet p90 9.06 s hit 0.401 false hits 10.4%   prefix_tree p90 9.23 s hit 0.454 false hits 20.8%

Under that pressure kvfleet's false hits are requests whose predicted blocks were evicted
between routing and admission (several requests ahead of them allocate first), and a recurring
one-block shortfall (predicted 624, found 608 for prompts past 650 tokens, the tree shows it too)
that this run did not explain; both are left open.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.bench import POLICIES, Workload
from cluster.bench_suite import SUMMARY_KEYS, Suite, run_suite
from cluster.hybrid_workload import HybridWorkload
from configs import load_config

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
        # 96 requests: at 48 every policy sat at the prompt order's hit bound (0.53: most
        # requests were a prefix's first), so hit rates could not differ
        hybrid=HybridWorkload(num_prefixes=12, num_requests=96, prefix_tokens=640, sweep_tokens=32),
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
    for run in result["shared_prefix"]["runs"].values():
        print(json.dumps({"workload": "shared_prefix", "model": main_cfg.model.source, **run}))
    for model, hybrid in result["hybrid"].items():
        for run in hybrid["runs"].values():
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
