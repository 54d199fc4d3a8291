"""vLLM's side of ``benchmarks/kv_cache_vs_vllm.py``: the anchor's drive.py, run as subprocesses.

Owns where the anchor and its venv live (``ANCHOR_DIR``, ``ANCHOR_VENV``), the mapping from
kvfleet's call names to drive.py's (``VLLM_CALL``), the driver (``VllmAnchor``, with
``CPU_CLOCK_LAUNCHER`` for ``--clock cpu``) and the medians over its runs (``summarize_vllm``).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.support.kv_replay import ConfigResult
from benchmarks.support.kv_trace import (
    BLOCK_SIZE,
    CALLS,
    DECODE_STEPS,
    NUM_BLOCKS,
    NUM_PREFIXES,
    PREFIX_LEN,
    SEED,
    SUFFIX_LEN,
    WINDOW,
)

LOG = logging.getLogger("kv_cache_vs_vllm")

# kvfleet call name -> drive.py's name for the same call
VLLM_CALL = {
    "lookup": "get_computed_blocks",
    "prefill_alloc": "allocate_prefill",
    "decode_alloc": "allocate_decode",
    "free": "free",
}

# Beside the repository: this file is <repo>/benchmarks/support/vllm_anchor.py.
ANCHOR_DIR = Path(
    os.environ.get("VLLM_KV_ANCHOR_DIR", Path(__file__).resolve().parents[3] / "shared" / "bench" / "vllm_kv_anchor")
)
ANCHOR_VENV = Path(os.environ.get("VLLM_ANCHOR_VENV", str(Path.home() / ".cache" / "kvfleet-anchors" / "vllm-venv")))


# -- vLLM side ------------------------------------------------------------------------------------------
class VllmAnchor:
    """vLLM's KVCacheManager driven by the anchor's drive.py, one subprocess per run."""

    def __init__(self, num_requests: int, anchor_dir: Path = ANCHOR_DIR, venv: Path = ANCHOR_VENV, clock: str = "wall"):
        self.num_requests = num_requests
        self.clock = clock
        self.anchor_dir = anchor_dir
        self.venv = venv

    def prepare(self) -> None:
        """Build the anchor venv if it is missing (install.sh is idempotent)."""
        LOG.info("vLLM anchor: %s (venv %s)", self.anchor_dir, self.venv)
        subprocess.run(["bash", str(self.anchor_dir / "install.sh"), str(self.venv)], check=True, stdout=sys.stderr)

    def run_once(self, kind: str, concurrency: int, run: int) -> tuple[dict, list[int] | None]:
        """One drive.py run of one configuration: its results.json run entry and per-request hits."""
        with tempfile.TemporaryDirectory(prefix="vllm-kv-anchor-") as out:
            drive = str(self.anchor_dir / "drive.py")
            launcher = [drive]
            if self.clock == "cpu":  # drive.py itself, with its per-call clock on thread CPU time
                launcher = ["-c", CPU_CLOCK_LAUNCHER, drive]
            cmd = [
                str(self.venv / "bin" / "python"),
                *launcher,
                "--kinds",
                kind,
                "--concurrency",
                str(concurrency),
                "--runs",
                "1",
                "--num-requests",
                str(self.num_requests),
                "--num-prefixes",
                str(NUM_PREFIXES),
                "--prefix-len",
                str(PREFIX_LEN),
                "--suffix-len",
                str(SUFFIX_LEN),
                "--decode-steps",
                str(DECODE_STEPS),
                "--block-size",
                str(BLOCK_SIZE),
                "--window",
                str(WINDOW),
                "--num-blocks",
                str(NUM_BLOCKS),
                "--seed",
                str(SEED),
                "--out",
                out,
            ]
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
                assert proc.stdout is not None
                for line in proc.stdout:
                    LOG.info("vllm: %s", line.rstrip().replace("run0]", f"run{run}]"))
            if proc.returncode:
                raise RuntimeError(f"drive.py failed with exit status {proc.returncode}")
            runs = json.loads((Path(out) / "results.json").read_text())["runs"]
            if len(runs) != 1 or runs[0]["kind"] != kind or runs[0]["concurrency"] != concurrency:
                raise RuntimeError(f"drive.py reported unexpected runs for {kind} C={concurrency}")
            hits_file = Path(out) / f"hits_{kind}_c{concurrency}.json"
            hits = json.loads(hits_file.read_text()) if hits_file.exists() else None
        return runs[0], hits


CPU_CLOCK_LAUNCHER = (
    "import runpy, sys, time; time.perf_counter_ns = time.thread_time_ns; "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def summarize_vllm(runs: list[dict], hits: list[int] | None) -> ConfigResult:
    return ConfigResult(
        mean_us={c: statistics.median(r["calls"][VLLM_CALL[c]]["mean_us"] for r in runs) for c in CALLS},
        token_hit_rate=statistics.median(r["prefix_cache"]["token_hit_rate"] for r in runs),
        hits=hits,
        preemptions=runs[0]["preemptions"],
    )
