"""Hybrid KV memory: prefix capacity per GiB and token hit rate of kvfleet's pooled layout against
the single padded page it replaced and vLLM 0.33's unified page.

Models: Bamba-9B, Granite-4.0-H-Small and Nemotron-H-8B, built from Hugging Face config classes
(BambaConfig, GraniteMoeHybridConfig, NemotronHConfig) with the published shapes; no weights.

1. Capacity (bf16 attention KV; recurrent states as kvfleet keeps them: fp32 conv window plus
   SSM state, the same state size for every layout so that only the layout differs), at
   ``--budget-gib`` per worker and ``--max-num-seqs`` running requests:
   * ideal: the budget minus the running requests' states (align mode: 2 per recurrent layer per
     request), all spent on attention KV, no padding, no cached states;
   * padded: today's old layout, one page per block for every group, the largest any layer needs
     (``padded_page_bytes``), groups cut by the smallest bucket;
   * vLLM unified: vLLM's own ``_align_hybrid_block_size`` (run in the anchor venv of
     ../shared/bench/vllm_kv_anchor by benchmarks/vllm_hybrid_block.py) picks the attention block
     that makes one attention page cover a state; groups by vLLM's rule (smallest bucket, or the
     largest if it is < 1.5x the smallest), one pool;
   * kvfleet: ``build_kv_layout`` + ``split_budget`` (config defaults).
   Each layout's cacheable prefix tokens are its attention tokens once the running states are
   reserved; ``capacity_over_ideal`` is kvfleet's over the ideal.
2. Token hit rate: a shared-prefix workload (``--prefixes`` prefixes, each reused ``--reuse``
   times, a unique suffix per request) whose shared length is swept over multiples of 16 that
   are not multiples of vLLM's block, run one request at a time through kvfleet's real
   ``Scheduler`` and ``HybridCoordinator`` twice at the same memory budget: with kvfleet's groups
   and pools, and with the unified layout's groups (block size = vLLM's inflated block, one
   pool). Both run the same prefill chunk, ``--chunk-tokens`` rounded down to a multiple of
   vLLM's block (at least one block: align mode caches a state only at a chunk end on a block
   boundary, and the scheduler cannot end a chunk short of one), then ``--decode-tokens``
   tokens, then free. Two chunk policies, the same for both layouts: ``boundary`` (the headline)
   is the scheduler as it is (``Scheduler.chunk_stop``): when the attention groups alone would
   hit further than the full hit, a chunk ends at that attention hit, so the recurrent state
   there is cached for the next request of the prefix (vLLM 0.33's shared-prefix junction stop
   does the same at its block); ``plain`` (``PlainScheduler``) does not.
   Why the same chunk: a prefix's second request resumes from the first request's last chunk
   end below the shared length, so with shorter chunks than the unified layout's kvfleet can
   resume lower: with ``--kvfleet-chunk-tokens 512`` (kvfleet's default chunk) against vLLM's
   1072, shared 2176 resumes at 2048 vs 2144, and the 32 tokens each later request gains over
   vLLM (2176 vs 2144) do not make up for it with 4 requests per prefix (0.673 vs 0.677).
   kvfleet's budget split in these runs is the workload-adapted one: ``state_cache_fraction``
   ``--hit-state-fraction`` (0.5) with ``expected_prefix_tokens`` = the shared length; the
   config defaults are reported as ``kvfleet_defaults``.
3. ``mamba_decode_speedup``: ``measure_decode`` of benchmarks/mamba_decode.py (Bamba-shaped
   random model, 32 running requests, per-request vs batched Mamba path), on this CPU, or read
   from ``--mamba-decode-json`` (the last line of a ``mamba_decode.py --device cuda`` run on a
   GPU machine, where the workers decode; ``details.mamba_decode.device`` names it).
4. ``coordinator_min_speedup``: read from ``--coordinator-json`` (the last line of
   benchmarks/kv_cache_vs_vllm.py) or, with ``--run-coordinator``, by running it
   (``--coordinator-args``).

Measured 2026-11-25 (2-core shared VM, ``--run-coordinator --coordinator-args "--clock cpu --runs
3"``; see benchmarks/README.md): capacity_over_ideal 0.950 / 0.948 / 0.948, capacity_vs_padded
63.3 / 62.7 / 63.1, capacity_vs_vllm_unified 0.961 / 0.953 / 0.950 (Bamba-9B /
Granite-4.0-H-Small / Nemotron-H-8B), mamba_decode_speedup 1.188 (mixers 55% of the step, 1.42x
faster), coordinator_min_speedup {retention_off 2.232, retention_on 1.911}. Hit sweep measured
2026-11-25 through the real scheduler, both layouts at 1072-token chunks: hit_rate_vs_vllm_unified
1.328, kvfleet higher at all eight splits (``plain``: 1.000, equal at every split: without the
chunk stop both cache states only at multiples of 1072); ``kvfleet_defaults`` 0.593 overall, as the
workload-adapted split (0.0 before ``MIN_CACHED_STATES``). With ``--kvfleet-chunk-tokens 512``:
1.433, lower at 2176 (0.673 vs 0.677).

The last stdout line is one JSON object with ``capacity_over_ideal``, ``capacity_vs_padded``,
``capacity_vs_vllm_unified`` (per model), ``hit_rate_vs_vllm_unified`` (kvfleet's total hit
tokens over the unified layout's, over the whole sweep of the first model), ``mamba_decode_speedup``,
``coordinator_min_speedup`` and the details. Progress goes to stderr.

Code: this script is the entry point (arguments, the decode and coordinator numbers, the report);
the model shapes and vLLM's block are in ``benchmarks/support/hybrid_models.py``, the capacity per
layout in ``benchmarks/support/hybrid_layouts.py`` and the hit sweep in
``benchmarks/support/hybrid_hits.py``. Every moved name is still importable from here.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.support.hybrid_hits import (
    hit_sweep,
)
from benchmarks.support.hybrid_layouts import capacity
from benchmarks.support.hybrid_models import (
    BLOCK,
    DTYPE,
    GIB,
    MODELS,
    ask_vllm,
    model_arch,
    vllm_shape,
)

log = logging.getLogger("hybrid_capacity")
ROOT = Path(__file__).resolve().parents[1]


# -- the other two numbers ----------------------------------------------------------------------------
def mamba_decode(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.mamba_decode_json:  # e.g. a GPU run: where production workers decode
        return json.loads(Path(args.mamba_decode_json).read_text().strip().splitlines()[-1])
    if args.skip_decode:
        return None
    from benchmarks.mamba_decode import measure_decode

    return measure_decode(num_requests=32)


def coordinator_speedup(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.coordinator_json:
        text = Path(args.coordinator_json).read_text().strip().splitlines()[-1]
        return json.loads(text).get("coordinator_min_speedup")
    if not args.run_coordinator:
        return None
    cmd = [sys.executable, "-m", "benchmarks.kv_cache_vs_vllm", *args.coordinator_args.split()]
    log.info("running %s", " ".join(cmd))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1]).get("coordinator_min_speedup")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV memory per worker for the capacity numbers")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="running requests whose states are reserved")
    ap.add_argument("--hit-budget-gib", type=float, default=8.0, help="KV memory of the hit-rate runs")
    ap.add_argument("--hit-max-num-seqs", type=int, default=4)
    ap.add_argument(
        "--hit-state-fraction",
        type=float,
        default=0.5,
        help="kvfleet's kv_cache.state_cache_fraction in the hit-rate runs (expected_prefix_tokens is "
        "the swept shared length); the config defaults are reported as kvfleet_defaults",
    )
    ap.add_argument("--splits", type=int, default=8, help="shared lengths in the sweep")
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--reuse", type=int, default=4, help="requests per prefix")
    ap.add_argument("--unique-tokens", type=int, default=200)
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=512,
        help="prefill chunk (scheduler.prefill_chunk_size) of both layouts, rounded down to a multiple "
        "of vLLM's block (at least one block)",
    )
    ap.add_argument(
        "--kvfleet-chunk-tokens",
        type=int,
        default=None,
        help="kvfleet's own prefill chunk instead (rounded down to 16): e.g. 512, its default",
    )
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-decode", action="store_true", help="mamba_decode_speedup: null")
    ap.add_argument(
        "--mamba-decode-json",
        help="a file whose last line is benchmarks/mamba_decode.py's JSON (e.g. its --device cuda run "
        "on a GPU machine) instead of measuring it here on the CPU",
    )
    ap.add_argument("--coordinator-json", help="a file whose last line is kv_cache_vs_vllm.py's JSON")
    ap.add_argument("--run-coordinator", action="store_true", help="run kv_cache_vs_vllm.py for the speedups")
    ap.add_argument("--coordinator-args", default="--runs 1 --num-requests 1000")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    archs = {name: model_arch(name) for name in names}
    vllm = ask_vllm([vllm_shape(name, arch) for name, arch in archs.items()])
    budget = int(args.budget_gib * GIB)
    caps = {name: capacity(arch, vllm[name], budget, args.max_num_seqs) for name, arch in archs.items()}
    for name, cap in caps.items():
        log.info(
            "%s: tokens/GiB ideal %.0f, kvfleet %.0f, padded %.0f, vLLM unified %.0f (block %d)",
            name,
            *(cap["tokens_per_gib"][k] for k in ("ideal", "kvfleet", "padded", "vllm_unified")),
            cap["vllm_block_size"]["kvfleet_state"],
        )
    hits = hit_sweep(archs[names[0]], caps[names[0]], vllm[names[0]], args)
    decode = mamba_decode(args)
    coordinator = coordinator_speedup(args)
    report = {
        "capacity_over_ideal": {n: c["over_ideal"]["kvfleet"] for n, c in caps.items()},
        "capacity_vs_padded": {n: c["tokens"]["kvfleet"] / c["tokens"]["padded"] for n, c in caps.items()},
        "capacity_vs_vllm_unified": {n: c["tokens"]["kvfleet"] / c["tokens"]["vllm_unified"] for n, c in caps.items()},
        "hit_rate_vs_vllm_unified": hits["boundary"]["ratio"],
        "mamba_decode_speedup": decode.get("mamba_decode_speedup") if decode else None,
        "coordinator_min_speedup": coordinator,
        "details": {
            "budget_gib": args.budget_gib,
            "max_num_seqs": args.max_num_seqs,
            "dtype": DTYPE,
            "block_size": BLOCK,
            "capacity": caps,
            "hit_rate": hits,
            "mamba_decode": decode,
        },
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
