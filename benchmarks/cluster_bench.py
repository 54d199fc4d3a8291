"""Cluster benchmark: shared-prefix workload, kvfleet's prefix-aware routing vs round robin, on
2 prefill + 2 decode workers (the workload logic lives in ``cluster.bench``; ``kvfleet bench``
runs the same thing).

    python benchmarks/cluster_bench.py                       # local preset (Gemma-3-270M)
    python benchmarks/cluster_bench.py --config tiny         # tiny random Gemma3, fast

Prints one JSON object per policy, then the summary as the last line:
``{"p90_ttft_ratio_vs_round_robin": r, "hit_rate_ratio_vs_round_robin": r, "tokens_per_s": {...}, ...}``

Measured on this project's machines (2 cores, Gemma-3-270M fp32, NIXL over loopback, default
workload: 8 prefixes x 16 requests, 256 + 16 tokens, 8 out, 4 in flight, pools at half the
prefix set + in-flight room = 601 blocks per worker), about 7 minutes in all:

    kvfleet      TTFT p50 0.47 s  p90 1.00 s  hit rate 0.88  12.5 output tok/s
    round_robin  TTFT p50 1.81 s  p90 3.78 s  hit rate 0.48   7.5 output tok/s
    p90_ttft_ratio_vs_round_robin 0.27, hit_rate_ratio_vs_round_robin 1.85

With the pools large enough for every prefix everywhere (``--cache-fraction 1.5``) the gap
shrinks to what duplicate first prefills cost (p90 ratio ~0.6-0.8, hit ratio ~1.25).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
