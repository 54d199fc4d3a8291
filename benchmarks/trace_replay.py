"""Replay a Mooncake-format request trace through the placement simulation with the real coordinators.

Reads the trace (``--trace``, default ``../shared/traces/mooncake_synthetic_trace.jsonl`` from the
repository root): per request a timestamp (ms), input and output lengths and the hash ids of its
512-token blocks. Each hash id becomes its own deterministic tokens, ``512 // --scale`` of them
(``--scale`` 8: a 15k-token prompt becomes about 1.9k tokens), the prompt is truncated to
``input_length // scale`` and the output to ``output_length // scale``. ``--start-s`` and
``--window-s`` keep a time window of the trace.

The replay (``benchmarks/support/routing_simulation.py``: the engine's coordinators on every
simulated worker, the router under test deciding each arrival with the loads of that instant)
runs kvfleet, the approximate prefix tree, round robin and least loaded at W = 8 and 16
(``--workers``), the cluster's device KV sized at ``--kv-ratio`` (0.5) of the trace's working set
(the distinct hash blocks' tokens), on three layouts (``--layouts``): ``full`` (full attention
alone), ``gemma_swa`` (Gemma-3-like: full attention beside a 512-token sliding window) and
``gemma_swa_host`` (that with every worker's host tier holding 4x its device pool: blocks the
device evicts are kept there and promoted back on a hit, each host-tier hit token costing a copy
at ``--promote-tps`` instead of a prefill, the cost the workers report to the router; the prefix
tree's eviction budget counts both tiers).

Metrics (after ``--warmup`` of the arrivals): hit rate (cached prompt tokens at admission / prompt
tokens), TTFT p50/p90, false-hit share (predicted hit tokens not found at admission / predicted
hit tokens, kvfleet and the tree only), decision cost p50/p99 (CPU time of ``route``).

Bounds (``bounds``, per layout and W; ``bound``): what no placement passes on this trace, from the
prompts alone: every request hits the longest prefix any earlier request shares with it (an
infinite cache that keeps every block and every window, on every worker) and starts at once (no
queue, no promote copy), so its TTFT is its uncached tokens at ``--prefill-tps``. The hit rate is
a ceiling and the TTFT percentiles are floors for every policy; ``p90_ttft_floor_vs_tree`` (the
floor over the tree's p90) is the least ``p90_ttft_ratio_vs_tree`` any router can reach. On the
synthetic trace (scale 8) the floor's p90 is 0.279 s: most of a p90 request's prompt is its own
(a first turn, or a turn whose new part is long), a prefill no placement avoids.

Output: progress on stderr (logging); one JSON object as the last stdout line::

    {"trace", "scale", "requests", "runs": {"<layout>/W=<n>": {"<policy>": {...}}},
     "bounds": {"<layout>/W=<n>": {"hit_rate", "ttft_p50_s", "ttft_p90_s"}},
     "ratios": {"<layout>/W=<n>": {"hit_ratio_vs_tree", "p90_ttft_ratio_vs_tree",
                                   "false_hit_kvfleet", "decision_p99_us",
                                   "hit_ceiling_vs_tree", "p90_ttft_floor_vs_tree"}}}

    python -m benchmarks.trace_replay                        # the whole synthetic trace
    python -m benchmarks.trace_replay --window-s 60 --workers 8   # a one-minute slice
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from benchmarks.support.mooncake_trace import build_trace, load_requests
from benchmarks.support.routing_results import Result
from benchmarks.support.routing_simulation import Simulation
from benchmarks.support.routing_trace import BLOCK, Trace
from benchmarks.support.stats import percentile
from engine.kv_cache import KVCacheGroup
from engine.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec

LOG = logging.getLogger("trace_replay")
POLICIES = ("kvfleet", "prefix_tree", "round_robin", "least_loaded")
TRACE_NAME = Path("shared") / "traces" / "mooncake_synthetic_trace.jsonl"


def default_trace() -> Path:
    """``../shared/traces/`` from the repository root, or from the nearest folder above it that has
    one (a git worktree sits one level deeper than the main checkout)."""
    root = Path(__file__).resolve().parent.parent
    for folder in root.parents:
        if (folder / TRACE_NAME).exists():
            return folder / TRACE_NAME
    return root.parent / TRACE_NAME


# The layouts: full attention alone; Gemma-3-like (full attention beside a 512-token sliding window)
LAYOUTS: dict[str, list[KVCacheGroup]] = {
    "full": [KVCacheGroup(FullAttentionSpec(BLOCK))],
    "gemma_swa": [KVCacheGroup(FullAttentionSpec(BLOCK)), KVCacheGroup(SlidingWindowSpec(BLOCK, window=512))],
    "gemma_swa_host": [KVCacheGroup(FullAttentionSpec(BLOCK)), KVCacheGroup(SlidingWindowSpec(BLOCK, window=512))],
}
#: per layout with a host tier: its blocks per pool, in device pools
HOST_FACTOR: dict[str, int] = {"gemma_swa_host": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=None, help="default: ../shared/traces/ (synthetic)")
    ap.add_argument("--scale", type=int, default=8, help="a 512-token hash block becomes 512 // scale tokens")
    ap.add_argument("--start-s", type=float, default=0.0, help="first trace second kept")
    ap.add_argument("--window-s", type=float, default=None, help="trace seconds kept (default: all)")
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--kv-ratio", type=float, default=0.5, help="cluster device KV / the trace's working set")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-tps", type=float, default=8000.0, help="prefill tokens per second per worker")
    ap.add_argument("--decode-tps", type=float, default=4000.0, help="amortised decode tokens per second per worker")
    ap.add_argument(
        "--promote-tps", type=float, default=160000.0, help="host-tier hit tokens copied to the device per second"
    )
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of arrivals left out of the metrics")
    ap.add_argument("--pin-replicas", type=int, default=2)
    args = ap.parse_args(argv)
    args.trace = args.trace or default_trace()
    if args.scale <= 0 or 512 % args.scale:
        ap.error(f"--scale must divide 512 (got {args.scale})")
    if not args.trace.exists():
        ap.error(f"--trace: no such file {args.trace}")
    return args


def false_hit_share(result: Result) -> float | None:
    rows = [r for r in result.measured() if r.predicted >= 0]
    predicted = sum(r.predicted for r in rows)
    if not rows or not predicted:
        return None if not rows else 0.0
    return sum(max(0, r.predicted - r.hit) for r in rows) / predicted


def metrics(result: Result) -> dict[str, float | None]:
    ttfts = sorted(r.ttft for r in result.measured())
    p50, p99 = result.decision_us()
    share = false_hit_share(result)
    return {
        "hit_rate": round(result.hit_rate(), 4),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
        "false_hit_share": None if share is None else round(share, 4),
        "decision_p50_us": round(p50, 1),
        "decision_p99_us": round(p99, 1),
        "imbalance": round(result.imbalance(), 3),
    }


def bound(trace: Trace, warmup: float, prefill_tps: float) -> dict[str, float]:
    """The ceiling of the hit rate and the floors of TTFT p50/p90 over the measured arrivals (after
    ``warmup`` of them), whatever the placement: each request hits the longest prefix of whole
    blocks it shares with any earlier request (at most ``num_tokens - 1`` tokens, as the
    coordinator asks) and is prefilled at once at ``prefill_tps``."""
    seen: set[bytes] = set()
    first = int(warmup * len(trace.arrivals))
    hit = total = 0
    ttfts: list[float] = []
    for k, arrival in enumerate(trace.arrivals):
        hashes = trace.prefix_hashes[arrival.prefix]
        n = len(trace.prefixes[arrival.prefix])
        shared = 0
        while shared < len(hashes) and hashes[shared] in seen:  # chained: a match is a whole prefix
            shared += 1
        seen.update(hashes)
        if k < first:
            continue
        cached = min(shared * BLOCK, n - 1)
        hit += cached
        total += n
        ttfts.append((n - cached) / prefill_tps)
    ttfts.sort()
    return {
        "hit_rate": round(hit / max(1, total), 4),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
    }


def ratio_row(
    kv: dict[str, float | None], tree: dict[str, float | None], best: dict[str, float]
) -> dict[str, float | None]:
    tree_hit, tree_p90 = max(1e-9, float(tree["hit_rate"] or 0)), max(1e-9, float(tree["ttft_p90_s"] or 0))
    return {
        "hit_ratio_vs_tree": round(float(kv["hit_rate"] or 0) / tree_hit, 3),
        "p90_ttft_ratio_vs_tree": round(float(kv["ttft_p90_s"] or 0) / tree_p90, 3),
        "false_hit_kvfleet": kv["false_hit_share"],
        "decision_p99_us": kv["decision_p99_us"],
        "hit_ceiling_vs_tree": round(best["hit_rate"] / tree_hit, 3),
        "p90_ttft_floor_vs_tree": round(best["ttft_p90_s"] / tree_p90, 3),
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    rows = load_requests(args.trace, args.start_s, args.window_s)
    if not rows:
        raise SystemExit("no requests in the chosen window")
    LOG.info("%s: %d requests over %.0f s, scale %d", args.trace.name, len(rows), rows[-1].time, args.scale)
    runs: dict[str, dict[str, dict[str, float | None]]] = {}
    ratios: dict[str, dict[str, float | None]] = {}
    bounds: dict[str, dict[str, float]] = {}
    for layout in args.layouts:
        groups = LAYOUTS[layout]
        for workers in args.workers:
            trace = build_trace(rows, workers, args.kv_ratio, args.scale, groups)
            key = f"{layout}/W={workers}"
            LOG.info(
                "%s: working set %d blocks, %d blocks per worker, %.2f req/s",
                key,
                trace.working_set_blocks,
                trace.num_blocks,
                trace.rate,
            )
            runs[key] = {}
            bounds[key] = bound(trace, args.warmup, args.prefill_tps)
            LOG.info("  %s bound (any placement): %s", key, bounds[key])
            for policy in args.policies:
                host = HOST_FACTOR.get(layout, 0)
                result = Simulation(args, trace, policy, label=f"{key} {policy}", groups=groups, host_factor=host).run()
                runs[key][policy] = metrics(result)
                LOG.info("  %s %s: %s (%.0f s)", key, policy, runs[key][policy], result.wall_s)
            if "kvfleet" in runs[key] and "prefix_tree" in runs[key]:
                ratios[key] = ratio_row(runs[key]["kvfleet"], runs[key]["prefix_tree"], bounds[key])
    report = {
        "trace": args.trace.name,
        "scale": args.scale,
        "requests": len(rows),
        "kv_ratio": args.kv_ratio,
        "runs": runs,
        "bounds": bounds,
        "ratios": ratios,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
