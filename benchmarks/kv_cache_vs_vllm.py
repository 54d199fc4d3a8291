"""kvfleet's hybrid KV-cache coordinator against vLLM's own KVCacheManager, same trace, same run.

What it measures
    Per manager call, the mean latency (``time.perf_counter_ns`` around each single call; with
    ``--clock cpu`` the calling thread's CPU time, ``time.thread_time_ns``, on both sides) of

    - ``lookup``        ``HybridCoordinator.get_computed_blocks`` (vLLM: ``get_computed_blocks``)
    - ``prefill_alloc`` ``allocate_slots`` at admission, after the lookup (vLLM: ``allocate_prefill``)
    - ``decode_alloc``  ``allocate_slots(req, 1)`` for each running request (vLLM: ``allocate_decode``)
    - ``free``          ``free`` of finished and of preempted requests (vLLM: ``free``)

    and the prefix-cache token hit rate, computed as vLLM's ``PrefixCacheStats`` does: hit tokens
    over prompt tokens of *first* admissions only (re-admissions after a preemption are excluded).
    Request construction (sha256 block hashing) is outside every timed call, as in vLLM.

Baseline
    ``../shared/bench/vllm_kv_anchor/drive.py`` (beside the repository) runs vLLM 0.33.0's pure-Python v1
    ``KVCacheManager`` in its own venv (built by the anchor's ``install.sh``). This script runs it
    through subprocesses in the same invocation and replays the very same deterministic trace and
    scheduling loop on kvfleet, so that the ratio ``speedup = vLLM mean µs / kvfleet mean µs``
    (medians over ``--runs`` runs) compares like with like on a noisy machine. The two sides are
    interleaved run by run (one drive.py subprocess per run, in alternating order) so that a slow
    spell of the machine hits both of them rather than one.

Trace (identical to drive.py; ``random.Random(0)``)
    20 prefixes of 1024 token ids; 2000 requests, request i = prefix ``rng.randrange(20)`` + a
    256-token suffix starting with ``30000 + i``; each request is prefilled, decodes 32 tokens
    (sampled token ``(i * 7 + step + 1) % 30000``) and is freed. Per step: ``new_step()``; decode
    every running request, preempting the newest on allocation failure; admit waiting requests FCFS
    up to concurrency C (none in a step that preempted); "execute"; free finished requests.
    Kinds: ``full`` (one full-attention group) and ``hybrid`` (full attention + 2 sliding-window
    groups, window 32), block size 16, 2048 blocks shared by all groups.

Configurations
    kvfleet runs every configuration twice: with retention OFF (``speedup``, ``hit_rate``) and with
    the pinned retention tier ON (``RETENTION`` below: ``speedup_retention``, ``pinned_hit_rate``).
    Both are interleaved with the vLLM runs of that configuration and compared with the same vLLM
    numbers.

Output
    Progress goes to stderr (logging). The last stdout line is one JSON object with ``speedup``,
    ``min_speedup`` (retention off), ``speedup_retention``, ``coordinator_min_speedup``
    (``{"retention_off": r, "retention_on": r}``: the smallest per-call speedup over every
    configuration), ``hit_rate``, ``pinned_hit_rate`` and, as extras, ``kvfleet_us``,
    ``kvfleet_retention_us``, ``vllm_us``, ``hits_vs_vllm`` and ``config``.

    python -m benchmarks.kv_cache_vs_vllm                 # full run, several minutes
    python -m benchmarks.kv_cache_vs_vllm --skip-vllm --runs 1 --num-requests 300
    python -m benchmarks.kv_cache_vs_vllm --clock cpu     # on a machine shared with other work

``--clock cpu`` runs drive.py unchanged, with ``time.perf_counter_ns`` pointed at
``time.thread_time_ns`` before it starts: time the process spends descheduled (other tenants of a
loaded machine) then counts on neither side; both sides still pay the clock call itself.

Code: this script is the entry point (arguments, one configuration's interleaved runs, the report);
the trace and its configurations are in ``benchmarks/support/kv_trace.py``, kvfleet's replay in
``benchmarks/support/kv_replay.py`` and the vLLM anchor's driver in
``benchmarks/support/vllm_anchor.py``. Every moved name is still importable from here.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict

from benchmarks.support import kv_replay
from benchmarks.support.kv_replay import (
    CLOCKS,
    ConfigResult,
    RunResult,
    run_kvfleet_once,
    summarize_kvfleet,
)
from benchmarks.support.kv_trace import (
    BLOCK_SIZE,
    CALLS,
    DECODE_STEPS,
    NO_RETENTION,
    NUM_BLOCKS,
    RETENTION,
    WINDOW,
    Trace,
    make_groups,
    make_trace,
    max_token_hit_rate,
)
from benchmarks.support.vllm_anchor import (
    VllmAnchor,
    summarize_vllm,
)
from engine.kv_cache import RetentionOptions

LOG = logging.getLogger("kv_cache_vs_vllm")


def compare_config(
    kind: str,
    concurrency: int,
    args: argparse.Namespace,
    prefixes: list[list[int]],
    trace: Trace,
    anchor: VllmAnchor | None,
) -> tuple[ConfigResult, ConfigResult, ConfigResult | None]:
    """kvfleet (retention off, then on) and vLLM runs of one configuration, interleaved run by run
    and in alternating order (vLLM first in even runs, last in odd ones), so that every side sees
    the same machine state."""
    ours: list[RunResult] = []
    retained: list[RunResult] = []
    theirs: list[dict] = []
    their_hits: list[int] | None = None
    retention = retention_options(args)
    for r in range(args.runs):
        sides = ["vllm", "off", "on"] if r % 2 == 0 else ["on", "off", "vllm"]
        for side in sides:
            if side == "off":
                ours.append(
                    run_kvfleet_once(kind, concurrency, NO_RETENTION, prefixes, trace, args.check_invariants, r)
                )
            elif side == "on":
                retained.append(
                    run_kvfleet_once(kind, concurrency, retention, prefixes, trace, args.check_invariants, r)
                )
            elif anchor is not None:
                run, hits = anchor.run_once(kind, concurrency, r)
                theirs.append(run)
                their_hits = their_hits if their_hits is not None else hits
    label = f"{kind} C={concurrency}"
    return (
        summarize_kvfleet(label, ours),
        summarize_kvfleet(f"{label} retention on", retained),
        summarize_vllm(theirs, their_hits) if theirs else None,
    )


# -- report -----------------------------------------------------------------------------------------------
def config_keys(kinds: list[str], concurrency: list[int]) -> list[str]:
    return [f"{kind}_c{c}" for kind in kinds for c in concurrency]


def parse_key(key: str) -> tuple[str, int]:
    kind, c = key.rsplit("_c", 1)
    return kind, int(c)


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return round(num / den, 3)


def compare_hits(ours: list[int] | None, theirs: list[int] | None) -> dict[str, int] | None:
    """Per-request first-admission hits: how many requests kvfleet hit less / more than vLLM."""
    if ours is None or theirs is None or len(theirs) != len(ours):
        return None
    return {
        "lower": sum(1 for a, b in zip(ours, theirs, strict=False) if a < b),
        "higher": sum(1 for a, b in zip(ours, theirs, strict=False) if a > b),
    }


def build_report(
    keys: list[str],
    kvfleet: dict[str, ConfigResult],
    retained: dict[str, ConfigResult],
    vllm: dict[str, ConfigResult] | None,
    args: argparse.Namespace,
    trace: Trace,
) -> dict:
    speedup: dict[str, dict[str, float | None]] = {}
    speedup_retention: dict[str, dict[str, float | None]] = {}
    hit_rate: dict[str, dict[str, float | None]] = {}
    hits_vs_vllm: dict[str, dict[str, int] | None] = {}
    for key in keys:
        ours = kvfleet[key]
        theirs = vllm[key] if vllm else None
        speedup[key] = {c: ratio(theirs.mean_us[c] if theirs else None, ours.mean_us[c]) for c in CALLS}
        speedup_retention[key] = {
            c: ratio(theirs.mean_us[c] if theirs else None, retained[key].mean_us[c]) for c in CALLS
        }
        hit_rate[key] = {
            "kvfleet": round(ours.token_hit_rate, 4),
            "vllm": round(theirs.token_hit_rate, 4) if theirs else None,
        }
        hits_vs_vllm[key] = compare_hits(ours.hits, theirs.hits) if theirs else None
    ratios = [r for per_call in speedup.values() for r in per_call.values() if r is not None]
    ratios_on = [r for per_call in speedup_retention.values() for r in per_call.values() if r is not None]
    return {
        "speedup": speedup,
        "min_speedup": min(ratios) if ratios else None,
        "speedup_retention": speedup_retention,
        "hit_rate": hit_rate,
        "pinned_hit_rate": {key: round(res.token_hit_rate, 4) for key, res in retained.items()},
        "kvfleet_us": {key: rounded(res.mean_us) for key, res in kvfleet.items()},
        "kvfleet_retention_us": {key: rounded(res.mean_us) for key, res in retained.items()},
        "vllm_us": {key: rounded(res.mean_us) for key, res in vllm.items()} if vllm else None,
        "hits_vs_vllm": hits_vs_vllm,
        "preemptions": {
            key: {"kvfleet": res.preemptions, "vllm": vllm[key].preemptions if vllm else None}
            for key, res in kvfleet.items()
        },
        "config": {
            "runs": args.runs,
            "num_requests": args.num_requests,
            "num_blocks": NUM_BLOCKS,
            "block_size": BLOCK_SIZE,
            "window": WINDOW,
            "decode_steps": DECODE_STEPS,
            "max_possible_token_hit_rate": round(max_token_hit_rate(trace), 4),
            "retention": asdict(retention_options(args)),
            "statistic": "median over runs of the per-call mean",
            "clock": args.clock,
        },
        "coordinator_min_speedup": {
            "retention_off": min(ratios) if ratios else None,
            "retention_on": min(ratios_on) if ratios_on else None,
        },
    }


def rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in values.items()}


# -- main ------------------------------------------------------------------------------------------------
def retention_options(args: argparse.Namespace) -> RetentionOptions:
    return RetentionOptions(
        enabled=True,
        budget_blocks=args.retention_budget,
        pin_sliding_window=True,
        min_drop_blocks=args.retention_min_drop_blocks,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per configuration (medians are reported)")
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--kinds", default="full,hybrid", help="comma list of full,hybrid")
    ap.add_argument("--concurrency", default="1,16", help="comma list of concurrency levels")
    ap.add_argument("--skip-vllm", action="store_true", help="kvfleet only (vLLM fields are null)")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="per-call clock on both sides: wall (perf_counter_ns) or cpu (thread_time_ns)",
    )
    ap.add_argument(
        "--check-invariants",
        type=int,
        default=0,
        metavar="N",
        help="call coord.check_invariants() every N steps (untimed; 0: never)",
    )
    ap.add_argument(
        "--retention-budget",
        type=int,
        default=RETENTION.budget_blocks,
        help="budget_blocks of the pinned_hit_rate runs (default: the documented RETENTION, no cap)",
    )
    ap.add_argument(
        "--retention-min-drop-blocks",
        type=int,
        default=RETENTION.min_drop_blocks,
        help="min_drop_blocks of the pinned_hit_rate runs (default: the documented RETENTION)",
    )
    args = ap.parse_args(argv)
    if args.runs < 1 or args.num_requests < 1:
        ap.error("--runs and --num-requests must be >= 1")
    args.kind_list = [k for k in args.kinds.split(",") if k]
    args.concurrency_list = [int(c) for c in args.concurrency.split(",") if c]
    for kind in args.kind_list:
        make_groups(kind)  # validates the kind
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    global clock_ns
    clock_ns = kv_replay.clock_ns = CLOCKS[args.clock]  # TraceRunner reads it from kv_replay
    prefixes, trace = make_trace(args.num_requests)
    keys = config_keys(args.kind_list, args.concurrency_list)
    anchor = None if args.skip_vllm else VllmAnchor(args.num_requests, clock=args.clock)
    if anchor is not None:
        anchor.prepare()

    kvfleet: dict[str, ConfigResult] = {}
    retained: dict[str, ConfigResult] = {}
    vllm: dict[str, ConfigResult] = {}
    for key in keys:
        kind, c = parse_key(key)
        ours, ours_retained, theirs = compare_config(kind, c, args, prefixes, trace, anchor)
        kvfleet[key] = ours
        retained[key] = ours_retained
        if theirs is not None:
            vllm[key] = theirs

    report = build_report(keys, kvfleet, retained, vllm or None, args, trace)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
