"""Chaos at scale: shared-prefix requests at a steady rate on a 2P+2D cluster while decode workers,
prefill workers and the router are killed in turn at seeded random moments
(``kvfleet_testing/chaos.py``; ``tests/integration/test_chaos.py`` is its bounded CI version).

Every request is checked against a single engine that ran its prompt alone, while it streams and
at its end. The last stdout line is
``{"requests": n, "completed": n, "migrated": n, "wrong_tokens": 0, "lost": 0, "errored": 0,
"kills": n, "recovery_s_p90": x, "blocks_leaked": 0, ...}`` (``migrated``: requests whose decode
worker was killed mid-stream and that completed on another one, see ``serve.migration_limit``);
``recovery_s`` of a kill runs until the cluster is whole again (replacement joined / workers
re-registered with the restarted router) and a request sent after the kill completed within
twice the median latency before the first kill (``latency_p50_before_kills_s``, the undisturbed
baseline). Exit status 1 on a wrong token, a lost request, an unclear error or a leaked block.

    python -m benchmarks.chaos_bench                          # 2000 requests, 8 req/s, 9 kills
    python -m benchmarks.chaos_bench --requests 300 --kills 3 --backend nixl
    python -m benchmarks.chaos_bench --requests 300 --kills 3 --tp 2   # split workers: a rank killed
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

log = logging.getLogger("chaos_bench")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=8.0, help="requests sent per second (open loop)")
    ap.add_argument("--kills", type=int, default=9, help="kills, cycling decode, prefill, router")
    ap.add_argument("--backend", choices=["local", "nixl"], default="local")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="workers.tensor_parallel_size: >1 runs two aggregated decode workers of that many ranks and kills ranks",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kvfleet_testing.chaos").setLevel(logging.INFO)
    from kvfleet_testing.chaos import run_chaos

    result = run_chaos(
        requests=args.requests,
        rate=args.rate,
        kills=args.kills,
        seed=args.seed,
        preset=args.preset,
        backend=args.backend,
        tensor_parallel_size=args.tp,
    )
    report = {key: value for key, value in result.as_dict().items() if key != "errors"}
    report.update(preset=args.preset, backend=args.backend, rate=args.rate, tp=args.tp, first_errors=result.errors[:5])
    print(json.dumps(report), flush=True)
    bad = result.wrong_tokens + result.wrong_stream + result.lost + result.unclear_errors + result.blocks_leaked
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
