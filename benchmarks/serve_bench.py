"""Serving benchmark: the OpenAI-compatible HTTP API (``kvfleet serve``) under a real load
generator (guidellm), on a shared-prefix workload, for the router policies kvfleet, prefix_tree
and round_robin; plus the HTTP layer's own cost against the driver API.

    python -m benchmarks.serve_bench                           # local preset (Gemma-3-270M), 2P+2D
    python -m benchmarks.serve_bench --rates 0.5,1.0 --policies kvfleet,round_robin

The load generator is guidellm, pinned in pyproject.toml's ``bench`` extra. It would downgrade
a package the project's environment has (click 8.5 -> 8.4; ray, torch, transformers and pydantic
stay as they are), so install it in a venv of its own, anywhere outside the repository ($LG
below), and name its executable (torch first, so that pip keeps the CPU wheel, not CUDA's):

    python3 -m venv $LG && $LG/bin/pip install torch==2.13.0 && $LG/bin/pip install guidellm==0.8.1
    KVFLEET_GUIDELLM=$LG/bin/guidellm python -m benchmarks.serve_bench

(``--guidellm PATH`` does the same; without either, ``guidellm`` is looked up next to this
Python, then on PATH.) The server is ``kvfleet serve`` from this Python's environment
(``--kvfleet PATH`` to use another).

Workload (``kvfleet_testing.workloads.SharedPrefixWorkload`` in text, since a load generator sends text):
``--num-prefixes`` documents of about ``--prefix-tokens`` tokens of pseudo-words, each asked
``--requests-per-prefix`` questions of about ``--suffix-tokens`` tokens, shuffled once; every
policy and every rate gets the same prompts in the same order, ``--max-tokens`` out with
``ignore_eos`` at temperature 0. Each worker's pool is sized as the cluster benchmark sizes it:
``--cache-fraction`` of the prefix set plus room for ``--in-flight`` requests, so a router that
spreads every prefix over every worker evicts. guidellm sends the requests at a constant rate
(``--rates``, requests/s); the ratios in the summary are taken at the highest rate.

Every (policy, rate) run gets a fresh server (a fresh cluster, caches empty) on a free loopback
port, warmed up identically before guidellm starts (one request at a time: ``--warmup`` short
unrelated prompts, then each prefix once with a warm-up question of its own, placed by the
policy under test; ``--no-warm-prefixes`` leaves the first sights in the measured run, where at
80 requests they and the requests queued behind them fill the p90 of every policy alike), and
stopped with SIGINT (the server drains) afterwards.

HTTP overhead: the first ``--overhead-requests`` prompts sent one at a time (kvfleet policy,
same config) to a fresh server and a fresh driver cluster running side by side, each prompt
through the driver API (``Cluster.stream``, timed by the caller to its first text delta) and
then through HTTP with a minimal streaming client (timed to the first chunk with text), so a
change in the machine's load weighs on both; ``http_ttft_overhead_ratio`` is HTTP TTFT p50 over
driver TTFT p50. Both sides time from the call, tokenizing included.

Last stdout line, one JSON object: ``tool``, ``tool_version``, ``p90_ttft_ratio_vs_round_robin``,
``p90_ttft_ratio_vs_prefix_tree`` (kvfleet's p90 TTFT over the baseline's at ``ratio_rate_rps``),
``http_ttft_overhead_ratio``, ``requests`` (every request sent: warmups, guidellm's, the overhead
passes), ``lost`` (those that did not complete), and per-policy per-rate details under ``runs``.
One JSON line per (policy, rate) run is printed before it. Progress goes to stderr (logging).

Measured on this project's machines (2 cores shared with other agents' test runs, 1-minute load
average 2.2-8.3 during the run; Gemma-3-270M fp32, 2P+2D, defaults: 5 prefixes x 16 requests of
273-277 tokens, 8 out, 364 blocks per worker, 0.5 and 1.0 req/s), 19.2 minutes:

    1.0 req/s   kvfleet      TTFT p50 0.171 s  p90 0.220 s  hit rate 0.934
                prefix_tree  TTFT p50 0.204 s  p90 0.223 s  hit rate 0.934
                round_robin  TTFT p50 0.310 s  p90 0.862 s  hit rate 0.506
    0.5 req/s   p90 0.221 / 0.315 / 0.937 s (same order), hit rates 0.934 / 0.934 / 0.506
    p90_ttft_ratio_vs_round_robin 0.256 (0.236 at 0.5), p90_ttft_ratio_vs_prefix_tree 0.986 (0.701
    at 0.5), http_ttft_overhead_ratio 1.059 (TTFT p50 0.147 s driver, 0.155 s HTTP), 584 requests,
    0 lost. The run after it (load average 1.5-12): 0.214, 0.833 (kvfleet p90 0.204 s, prefix_tree
    0.245 s), 1.137, 584 requests, 0 lost.

Every measured kvfleet request found its prefix cached: its router's ``route_outcomes`` show no
decision below the best worker's hit (75 ``decode_only`` and 5 ``prefix`` hits at 1.0 req/s; the
misses are the warm-up's 2 unrelated prompts and 5 first sights). Before the guard change (commit
6a51cc6) 5-6 of kvfleet's 80 requests at 1.0 req/s were sent to a prefill worker without their
warmed prefix (TTFT 1.0-1.7 s; p90 0.505 s, ratio vs prefix_tree 1.986): the work guard compared
each prefill worker's recent work with the mean over all four workers, decode workers included,
and left an idle holder out (reproduced in tests/routing/test_guards.py). The p90 at this size is
sensitive to the machine's load: a run at load average 9-32 (its prefix_tree server's GCS died
under it, losing 58 requests) gave kvfleet p90 0.509 s from a 12-second stall that slowed 10
requests, all of them hits.
Without the prefix warm-up (two earlier runs) the first sights and the requests queued behind
them set every policy's p90 (ratios vs round robin 0.38 and 1.03 at 1.0 req/s, vs prefix_tree
0.57 and 0.91, with the machine's load).

Code: this script is the entry point (arguments, main, the summary and the JSON line); the workload
is in ``benchmarks/support/serve_workload.py``, the server in ``serve_server.py`` and its HTTP
client in ``serve_http.py``, guidellm's driving in ``serve_loadgen.py``, the parsing of its
report in ``serve_results.py`` and the runs in ``serve_runs.py`` (same folder). Every moved name is
still importable from here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.support.serve_loadgen import (
    TOOL,
    find_tool,
    pinned_version,
    tool_version,
)
from benchmarks.support.serve_results import ratio
from benchmarks.support.serve_runs import Bench
from benchmarks.support.serve_workload import (
    Workload,
    build_prompts,
    sized_overrides,
    warmup_prompts,
)

log = logging.getLogger("serve_bench")

POLICIES = ("kvfleet", "prefix_tree", "round_robin")
BENCH_WORKERS = ("workers.num_prefill=2", "workers.num_decode=2")


def summary(runs: dict[str, dict[str, dict[str, Any]]], rate: float) -> dict[str, Any]:
    """kvfleet's p90 TTFT over each baseline's at ``rate`` (and at every rate, under ``by_rate``)."""
    key = f"{rate:g}"
    ours = runs.get("kvfleet", {})
    out: dict[str, Any] = {}
    for base in ("round_robin", "prefix_tree"):
        theirs = runs.get(base, {})
        out[f"p90_ttft_ratio_vs_{base}"] = ratio(
            (ours.get(key) or {}).get("ttft_p90_s"), (theirs.get(key) or {}).get("ttft_p90_s")
        )
        out[f"p90_ttft_ratio_vs_{base}_by_rate"] = {
            r: ratio(ours[r]["ttft_p90_s"], theirs[r]["ttft_p90_s"]) for r in ours if r in theirs
        }
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = Workload()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="local", help="preset name or YAML path (default: local)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every server and the driver cluster (repeatable)",
    )
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated router policies")
    p.add_argument("--rates", default="0.5,1.0", help="comma-separated request rates (requests/s), low to high")
    p.add_argument("--num-prefixes", type=int, default=d.num_prefixes)
    p.add_argument("--requests-per-prefix", type=int, default=d.requests_per_prefix)
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    p.add_argument("--suffix-tokens", type=int, default=d.suffix_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--in-flight", type=int, default=d.in_flight, help="requests in flight the pools leave room for")
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=d.cache_fraction,
        help="each worker's pool as a share of the prefix set (0: the config's own size)",
    )
    p.add_argument("--warmup", type=int, default=d.warmup, help="short unrelated requests before each run")
    p.add_argument(
        "--no-warm-prefixes",
        dest="warm_prefixes",
        action="store_false",
        help="do not send each prefix once before each run (first sights land in the measured run)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--overhead-requests", type=int, default=24, help="sequential requests for the HTTP-vs-driver TTFT (0: skip)"
    )
    p.add_argument("--guidellm", default=None, help="guidellm executable (default: $KVFLEET_GUIDELLM, then PATH)")
    p.add_argument("--kvfleet", default=None, help="kvfleet executable (default: next to this Python, then PATH)")
    p.add_argument("--out-dir", default=None, help="where reports and server logs go (default: a new temp dir)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S"
    )
    args = parse_args(argv)
    started, load_start = time.monotonic(), round(os.getloadavg()[0], 2)
    from configs import load_config
    from engine.core import resolve_model_directory
    from engine.tokenizer import load_tokenizer

    workload = Workload(
        args.num_prefixes,
        args.requests_per_prefix,
        args.prefix_tokens,
        args.suffix_tokens,
        args.max_tokens,
        args.in_flight,
        args.cache_fraction,
        args.warmup,
        args.warm_prefixes,
        args.seed,
    )
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
    tool = find_tool(args.guidellm)
    version, pinned = tool_version(tool), pinned_version()
    if pinned and version != pinned:
        log.warning("%s %s at %s, but pyproject.toml's bench extra pins %s", TOOL, version, tool, pinned)
    kvfleet = args.kvfleet or next(
        (c for c in (str(Path(sys.executable).parent / "kvfleet"), shutil.which("kvfleet")) if c and Path(c).is_file()),
        "kvfleet",
    )
    overrides = [*BENCH_WORKERS, *args.overrides]
    config = load_config(args.config, overrides)
    model_dir = resolve_model_directory(config)
    tokenizer = load_tokenizer(model_dir, 0)
    prefixes, prompts = build_prompts(workload, tokenizer)
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    prefix_len = max(len(tokenizer.encode(p.split("\n")[0] + "\n")) for p in prompts)
    overrides += sized_overrides(config, workload, max(lengths), prefix_len)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="serve_bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "prompts.jsonl").open("w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt, "output_tokens_count": workload.max_tokens}) + "\n")
    log.info(
        "%s %s (%s); %d prompts of %d-%d tokens (prefixes %d); overrides %s; output in %s",
        TOOL,
        version,
        tool,
        len(prompts),
        min(lengths),
        max(lengths),
        prefix_len,
        overrides,
        out_dir,
    )
    bench = Bench(
        kvfleet,
        args.config,
        overrides,
        tool,
        model_dir,
        workload,
        prompts,
        warmup_prompts(workload, tokenizer, prefixes),
        out_dir,
    )

    runs: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in policies}
    for rate in rates:  # policies interleaved at each rate, so a drift in the machine's load hits all alike
        for policy in policies:
            try:
                result = bench.run_policy(policy, rate)
            except Exception as exc:
                log.exception("%s at %g req/s failed", policy, rate)
                bench.sent += len(prompts)
                bench.lost += len(prompts)
                result = {"policy": policy, "rate_rps": rate, "error": f"{type(exc).__name__}: {exc}"}
            runs[policy][f"{rate:g}"] = result
            print(json.dumps(result), flush=True)
    overhead: dict[str, Any] = {}
    if args.overhead_requests > 0:
        try:
            overhead = bench.http_overhead(args.overhead_requests)
        except Exception as exc:
            log.exception("HTTP overhead measurement failed")
            overhead = {"error": f"{type(exc).__name__}: {exc}"}
    final = {
        "tool": TOOL,
        "tool_version": version,
        **summary(runs, rates[-1]),
        "ratio_rate_rps": rates[-1],
        "http_ttft_overhead_ratio": overhead.get("http_ttft_overhead_ratio"),
        "requests": bench.sent,
        "lost": bench.lost,
        "runs": runs,
        "http_overhead": overhead,
        "workload": {
            **asdict(workload),
            "prompt_tokens": [min(lengths), max(lengths)],
            "prefix_tokens_measured": prefix_len,
        },
        "config": {"preset": args.config, "overrides": overrides},
        "loadavg_1m": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(final), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
