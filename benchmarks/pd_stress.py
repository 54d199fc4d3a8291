"""P/D stress: every request's greedy tokens against a single engine that ran the prompt alone.

Two levels (both by default):

- ``engine``: prefill and decode ``EngineCore`` pairs in this process, driven through seeded
  adversarial interleavings (bursts of shared-prefix requests, a small token budget that leaves
  1-token remainders, handles delivered late, a small pool, requests run whole on a decode
  engine beside pulled ones); see ``kvfleet_testing/pd_harness.py``. Reproducible per seed.
- ``cluster``: a local Ray cluster per configuration, concurrent waves of shared-prefix requests
  while ``--busy`` processes spin on the cores; see ``kvfleet_testing/pd_stress.py``.

Each configuration prints one JSON line as it finishes; the last stdout line is the summary:
``{"requests": n, "wrong_tokens": n, "configs": {"<level>/<preset>/<backend>/<P>P<D>D":
{"requests": n, "wrong_tokens": n, ...}}, "seconds": s}``. Exit status 1 if any token was wrong.

    python -m benchmarks.pd_stress                                   # both levels, every config
    python -m benchmarks.pd_stress --level engine --seeds 50         # engine level, 50 seeds each
    python -m benchmarks.pd_stress --level cluster --requests 300 --busy 2 --presets tiny-hybrid

Measured on this project's 2-core VM (the wrong-token bug's cause and fix: the docstring of
tests/engine/test_pd_race.py). ``--level engine --seeds 10 --requests 60`` (4800 requests):
before the fix 22 wrong, all tiny-hybrid (local 2P+2D 11 of 600, nixl 2P+2D 10, nixl 1P+1D 1,
local 1P+1D 0; tiny 0 of 2400), 3.2 min; after it 0, and 0 of 12000 more with
``--presets tiny-hybrid --seeds 25 --seed 100 --requests 120`` (9 min). ``--level cluster
--presets tiny-hybrid --shapes 2x2 --requests 96 --busy 2``: before, nixl 1 wrong of 96
(prefill-1 -> decode-1, 64 cached tokens as predicted, diverged at token 3), local 0 of 96;
after, 0 of 192 (6.6 min).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

log = logging.getLogger("pd_stress")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--level", choices=["engine", "cluster", "both"], default="both")
    ap.add_argument("--presets", nargs="+", default=["tiny", "tiny-hybrid"])
    ap.add_argument("--backends", nargs="+", default=["local", "nixl"], choices=["local", "nixl"])
    ap.add_argument("--shapes", nargs="+", default=["1x1", "2x2"], help="prefill x decode workers, e.g. 2x2")
    ap.add_argument("--requests", type=int, default=120, help="requests per seed (engine) / per config (cluster)")
    ap.add_argument("--seeds", type=int, default=10, help="engine level: seeds per configuration")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--busy", type=int, default=2, help="cluster level: processes spinning on the cores")
    ap.add_argument("--wave", type=int, default=16, help="cluster level: requests submitted together")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)
    from configs import load_config
    from kvfleet_testing.pd_harness import alone_tokens, run_engine_stress
    from kvfleet_testing.workloads import shared_prefix_prompts

    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes]
    backends = list(args.backends)
    if "nixl" in backends:
        try:
            import nixl  # noqa: F401
        except ImportError:
            log.warning("nixl is not installed: local backend only")
            backends.remove("nixl")
    configs: dict[str, dict] = {}
    start = time.monotonic()
    seeds = list(range(args.seed, args.seed + args.seeds))
    if args.level in ("engine", "both"):
        for preset in args.presets:
            prompts = [p for seed in seeds for p in shared_prefix_prompts(seed, args.requests)]
            oracle = alone_tokens(load_config(preset), prompts)
            for backend in backends:
                for num_prefill, num_decode in shapes:
                    name = f"engine/{preset}/{backend}/{num_prefill}P{num_decode}D"
                    summary = {"requests": 0, "wrong_tokens": 0, "runs_with_wrong_tokens": [], "preemptions": 0}
                    for seed in seeds:
                        result = run_engine_stress(
                            preset, backend, num_prefill, num_decode, requests=args.requests, seed=seed, oracle=oracle
                        )
                        summary["requests"] += result.requests
                        summary["wrong_tokens"] += result.wrong_tokens
                        summary["preemptions"] += result.preemptions
                        if result.wrong_tokens:
                            wrong = {"seed": seed, "mismatches": result.mismatches[:4]}
                            summary["runs_with_wrong_tokens"].append(wrong)
                    configs[name] = summary
                    print(json.dumps({"config": name, **summary}), flush=True)
    if args.level in ("cluster", "both"):
        from kvfleet_testing.pd_stress import busy_cpu, run_cluster_stress

        with busy_cpu(args.busy):
            for preset in args.presets:
                for backend in backends:
                    for num_prefill, num_decode in shapes:
                        name = f"cluster/{preset}/{backend}/{num_prefill}P{num_decode}D"
                        log.info("%s: %d requests, %d busy processes", name, args.requests, args.busy)
                        result = run_cluster_stress(
                            preset,
                            backend,
                            num_prefill,
                            num_decode,
                            requests=args.requests,
                            wave=args.wave,
                            seed=args.seed,
                        )
                        entry = result.as_dict()
                        entry.pop("config")
                        configs[name] = entry
                        print(json.dumps({"config": name, **entry}), flush=True)
    report = {
        "requests": sum(c["requests"] for c in configs.values()),
        "wrong_tokens": sum(c["wrong_tokens"] for c in configs.values()),
        "configs": {
            name: {"requests": c["requests"], "wrong_tokens": c["wrong_tokens"]} for name, c in configs.items()
        },
        "seconds": round(time.monotonic() - start, 1),
    }
    print(json.dumps(report), flush=True)
    return 1 if report["wrong_tokens"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
