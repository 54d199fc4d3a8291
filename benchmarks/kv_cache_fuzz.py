"""Long-running random-operation fuzzer for the hybrid KV-cache coordinator.

What it does
    Drives ``HybridCoordinator`` through the simulated scheduler of ``kvfleet_testing/kv_cache_sim/``
    (the same one the hypothesis state machine uses) with plain ``random``: arrivals (shared
    prefixes, salts, remote-prefill requests), admissions with local hits, external tokens and
    asynchronous loads, prefill chunks (block-aligned for Mamba), decode, preemption, load
    completions and failures, aborts, window maintenance, explicit prefix pins and unpins, prefix
    cache resets and step boundaries. After every operation it runs ``coord.check_invariants()``
    plus the simulator's own checks (hit == brute-force oracle, failed allocations change nothing,
    KV events replay to the pool's maps, a data model of what every block holds, eviction order),
    and ``drain`` (everything freed, every pin released: all blocks free again) ends every segment.

    The run is split into segments of ``--segment-ops`` operations, each with its own random
    configuration (group mix, block sizes, 12-64 blocks, or for multi-pool mixes one pool per page
    size with pools of different sizes, retention on/off, caching on/off, events, vocabulary) and
    its own seed, drawn from ``--seed``. ``--multi-pool`` draws only mixes with several block pools.

Output
    Progress goes to stderr (logging, every 10 %). The last stdout line is one JSON object:
    ``{"ops", "violations", "seconds", "counts": {operation kind: count}, "outcomes": {...},
    "segments", "seed"}``. On a violation the reproduction (seed, global op index, segment seed,
    op index in the segment, configuration, recent operations, the error) is printed and the
    script exits with status 1 (after the JSON line, which then has ``"violations": 1``).

    python -m benchmarks.kv_cache_fuzz --ops 1000000 --seed 0
    python -m benchmarks.kv_cache_fuzz --ops 1000000 --seed 0 --multi-pool
    python -m benchmarks.kv_cache_fuzz --segment-seed 123456 --ops 1500    # replay one segment
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
import traceback
from collections import Counter

from kvfleet_testing.kv_cache_sim import MIX_POOLS, RandomDriver, Sim, random_config

LOG = logging.getLogger("kv_cache_fuzz")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ops", type=int, default=1_000_000, help="operations in total (default 1,000,000)")
    ap.add_argument("--seed", type=int, default=0, help="master seed (segment seeds are drawn from it)")
    ap.add_argument("--segment-ops", type=int, default=2000, help="operations per configuration (default 2000)")
    ap.add_argument(
        "--segment-seed",
        type=int,
        default=None,
        help="replay the single segment with this seed (as printed by a violation), for --ops operations",
    )
    ap.add_argument("--multi-pool", action="store_true", help="only mixes with several block pools")
    ap.add_argument("--trace", type=int, default=40, help="recent operations printed with a violation")
    args = ap.parse_args(argv)
    if args.ops < 1 or args.segment_ops < 1:
        ap.error("--ops and --segment-ops must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    master = random.Random(args.seed)
    counts: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    mixes: Counter[str] = Counter()
    done = 0
    segments = 0
    violation: dict | None = None
    next_report = 1
    start = time.perf_counter()
    while done < args.ops and violation is None:
        seg_seed = args.segment_seed if args.segment_seed is not None else master.randrange(1 << 62)
        rng = random.Random(seg_seed)
        cfg = random_config(rng, sorted(MIX_POOLS) if args.multi_pool else None)
        segments += 1
        mixes[cfg.mix] += 1
        seg_ops = args.ops - done if args.segment_seed is not None else min(args.segment_ops, args.ops - done)
        sim: Sim | None = None
        kind = "setup"
        seg_index = 0
        try:
            sim = Sim(cfg, trace_len=max(args.trace, 1))
            driver = RandomDriver(sim, rng)
            for seg_index in range(seg_ops):  # noqa: B007 - read by the failure report below
                kind = driver.pick()
                driver.step(kind)
                counts[kind] += 1
                done += 1
                if done * 10 >= next_report * args.ops:
                    LOG.info(
                        "%3d%%  %d ops, %d segments, %.1f s",
                        100 * done // args.ops,
                        done,
                        segments,
                        time.perf_counter() - start,
                    )
                    next_report = done * 10 // args.ops + 1
            kind = "drain"
            seg_index = seg_ops
            sim.drain()
            counts["drain"] += 1
        except Exception as exc:  # noqa: BLE001 - every failure is a reported violation
            violation = {
                "seed": args.seed,
                "op_index": done,
                "segment_seed": seg_seed,
                "segment_op_index": seg_index,
                "kind": kind,
                "config": cfg.describe(),
                "error": f"{type(exc).__name__}: {exc}",
            }
            print("VIOLATION", file=sys.stdout)
            for key, value in violation.items():
                print(f"  {key}: {value}", file=sys.stdout)
            if sim is not None:
                print("  recent operations:", file=sys.stdout)
                for line in list(sim.trace)[-args.trace :]:
                    print(f"    {line}", file=sys.stdout)
            print("  traceback:", file=sys.stdout)
            print(traceback.format_exc(), file=sys.stdout)
            print(
                f"  reproduce: python -m benchmarks.kv_cache_fuzz --segment-seed {seg_seed} --ops {seg_index + 1}"
                f"{' --multi-pool' if args.multi_pool else ''}",
                file=sys.stdout,
            )
        if sim is not None:
            outcomes.update(sim.counts)
    seconds = time.perf_counter() - start
    report = {
        "ops": done,
        "violations": 0 if violation is None else 1,
        "seconds": round(seconds, 2),
        "counts": dict(sorted(counts.items())),
        "outcomes": dict(sorted(outcomes.items())),
        "segments": segments,
        "mixes": dict(sorted(mixes.items())),
        "seed": args.seed,
        "multi_pool": args.multi_pool,
    }
    if violation is not None:
        report["violation"] = violation
    print(json.dumps(report), flush=True)
    return 0 if violation is None else 1


if __name__ == "__main__":
    sys.exit(main())
