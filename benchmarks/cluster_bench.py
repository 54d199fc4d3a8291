"""Cluster benchmark: shared-prefix workload, kvfleet's prefix-aware routing vs round robin, on
2 prefill + 2 decode workers (the workload logic lives in ``cluster.bench``; ``kvfleet bench``
runs the same thing).

    python benchmarks/cluster_bench.py                       # local preset (Gemma-3-270M)
    python benchmarks/cluster_bench.py --config tiny         # tiny random Gemma3, fast

Prints one JSON object per policy, then the summary as the last line:
``{"p90_ttft_ratio_vs_round_robin": r, "hit_rate_ratio_vs_round_robin": r, "tokens_per_s": {...}, ...}``
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
