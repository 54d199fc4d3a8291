#!/usr/bin/env python3
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

    python benchmarks/kv_cache_vs_vllm.py                 # full run, several minutes
    python benchmarks/kv_cache_vs_vllm.py --skip-vllm --runs 1 --num-requests 300
    python benchmarks/kv_cache_vs_vllm.py --clock cpu     # on a machine shared with other work

``--clock cpu`` runs drive.py unchanged, with ``time.perf_counter_ns`` pointed at
``time.thread_time_ns`` before it starts: time the process spends descheduled (other tenants of a
loaded machine) then counts on neither side; both sides still pay the clock call itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.kv_cache import (
    CacheRequest,
    FullAttentionSpec,
    HybridCoordinator,
    KVCacheGroup,
    RetentionOptions,
    SlidingWindowSpec,
)

LOG = logging.getLogger("kv_cache_vs_vllm")

# -- trace parameters: drive.py's defaults (they must stay equal for the comparison to hold) --------
VOCAB = 30000
SEED = 0
NUM_PREFIXES = 20
PREFIX_LEN = 1024
SUFFIX_LEN = 256
DECODE_STEPS = 32
BLOCK_SIZE = 16
WINDOW = 32
NUM_BLOCKS = 2048

# The one retention configuration behind ``pinned_hit_rate``: the engine's default tier (no cap, so
# the retained tier may hold the whole pool and is demoted oldest-first under allocation pressure).
# Retained on this trace: each request's shared full-attention prefix at free time, and the
# sliding-window anchors at the 1024-token junction when the prefill-to-decode drop releases them.
# Measured (2000 requests, C=1 / C=16, hit rates are deterministic): cap 256 -> 0.560 / 0.433,
# cap 1024 -> 0.702 / 0.713, no cap -> 0.782 / 0.713 (ceiling 0.792).
RETENTION = RetentionOptions(enabled=True, budget_blocks=None, pin_sliding_window=True, min_drop_blocks=2)
NO_RETENTION = RetentionOptions(enabled=False)

CALLS = ("lookup", "prefill_alloc", "decode_alloc", "free")
# kvfleet call name -> drive.py's name for the same call
VLLM_CALL = {
    "lookup": "get_computed_blocks",
    "prefill_alloc": "allocate_prefill",
    "decode_alloc": "allocate_decode",
    "free": "free",
}

ANCHOR_DIR = Path(
    os.environ.get("VLLM_KV_ANCHOR_DIR", Path(__file__).resolve().parents[2] / "shared" / "bench" / "vllm_kv_anchor")
)
ANCHOR_VENV = Path(
    os.environ.get("VLLM_ANCHOR_VENV", str(Path.home() / ".cache" / "kvfleet-anchors" / "vllm-venv"))
)

Trace = list[tuple[int, list[int]]]

# The per-call clock (``--clock``): wall time by default, or the calling thread's CPU time.
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
clock_ns = CLOCKS["wall"]


# -- trace ----------------------------------------------------------------------------------------
def make_trace(num_requests: int, seed: int = SEED) -> tuple[list[list[int]], Trace]:
    """Prefixes and (prefix index, suffix) per request, drawing from the rng in drive.py's order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    trace: Trace = []
    for i in range(num_requests):
        p = rng.randrange(NUM_PREFIXES)
        suffix = [VOCAB + i] + [rng.randrange(VOCAB) for _ in range(SUFFIX_LEN - 1)]
        trace.append((p, suffix))
    return prefixes, trace


def max_token_hit_rate(trace: Trace) -> float:
    """Every reuse of a prefix hits all of it; first uses hit nothing."""
    first_uses = len({p for p, _ in trace})
    return (len(trace) - first_uses) * PREFIX_LEN / (len(trace) * (PREFIX_LEN + SUFFIX_LEN))


def make_groups(kind: str) -> list[KVCacheGroup]:
    full = KVCacheGroup(FullAttentionSpec(BLOCK_SIZE), ("layer.full",))
    if kind == "full":
        return [full]
    if kind == "hybrid":
        swa = SlidingWindowSpec(BLOCK_SIZE, window=WINDOW)
        return [full, KVCacheGroup(swa, ("layer.swa1",)), KVCacheGroup(swa, ("layer.swa2",))]
    raise ValueError(f"kind: expected 'full' or 'hybrid' (got {kind!r})")


# -- one kvfleet run --------------------------------------------------------------------------------
@dataclass
class Entry:
    """A request in the scheduler loop; ``step`` is drive.py's ``ent[2]`` (-1: prefill pending)."""

    req: CacheRequest
    idx: int
    step: int = -1
    preempted: bool = False


@dataclass
class RunResult:
    kind: str
    concurrency: int
    retention: bool
    mean_us: dict[str, float]
    num_calls: dict[str, int]
    token_hit_rate: float
    hits: list[int]
    preemptions: int
    admission_failures: int
    steps: int
    wall_s: float
    make_request_us: float
    end_free_blocks: int


class Timings:
    """Nanoseconds of every timed call, by call name."""

    def __init__(self) -> None:
        self.ns: dict[str, list[int]] = {name: [] for name in (*CALLS, "make_request")}

    def mean_us(self, name: str) -> float:
        samples = self.ns[name]
        return sum(samples) / len(samples) / 1e3 if samples else float("nan")


class TraceRunner:
    """Replays drive.py's scheduling loop against one fresh ``HybridCoordinator``."""

    def __init__(
        self,
        kind: str,
        concurrency: int,
        retention: RetentionOptions,
        prefixes: list[list[int]],
        trace: Trace,
        check_every: int = 0,
    ):
        self.kind = kind
        self.concurrency = concurrency
        self.retention = retention
        self.prefixes = prefixes
        self.trace = trace
        self.check_every = check_every
        self.coord = HybridCoordinator(
            make_groups(kind), NUM_BLOCKS, enable_caching=True, retention=retention, enable_events=False
        )
        self.t = Timings()
        self.waiting: deque[int | Entry] = deque(range(len(trace)))
        self.running: list[Entry] = []
        self.hits = [0] * len(trace)
        self.queries = 0
        self.hit_tokens = 0
        self.preemptions = 0
        self.admission_failures = 0
        self.steps = 0

    def run(self) -> RunResult:
        gc.collect()
        start = time.perf_counter()
        while self.waiting or self.running:
            self.step()
            if self.check_every and self.steps % self.check_every == 0:
                self.coord.check_invariants()
        wall = time.perf_counter() - start
        if self.check_every:
            self.coord.check_invariants()
        return RunResult(
            kind=self.kind,
            concurrency=self.concurrency,
            retention=self.retention.enabled,
            mean_us={name: self.t.mean_us(name) for name in CALLS},
            num_calls={name: len(self.t.ns[name]) for name in CALLS},
            token_hit_rate=self.hit_tokens / self.queries if self.queries else 0.0,
            hits=self.hits,
            preemptions=self.preemptions,
            admission_failures=self.admission_failures,
            steps=self.steps,
            wall_s=wall,
            make_request_us=self.t.mean_us("make_request"),
            end_free_blocks=self.coord.num_free_blocks,
        )

    def step(self) -> None:
        self.steps += 1
        self.coord.new_step()
        scheduled, preempted = self.decode_running()
        newly = [] if preempted else self.admit_waiting()
        for ent in scheduled + newly:
            self.execute(ent)
        self.running.extend(newly)
        self.free_finished()

    def decode_running(self) -> tuple[list[Entry], bool]:
        """One decode allocation per running request; on failure preempt the newest and retry."""
        coord, running, ns = self.coord, self.running, self.t.ns["decode_alloc"]
        pc = clock_ns
        scheduled: list[Entry] = []
        preempted = False
        i = 0
        while i < len(running):
            ent = running[i]
            while True:
                t0 = pc()
                ids = coord.allocate_slots(ent.req, 1)
                ns.append(pc() - t0)
                if ids is not None:
                    break
                victim = running.pop()
                self.preempt(victim)
                preempted = True
                if victim is ent:
                    break
            if ids is None:
                break  # the request itself was preempted
            scheduled.append(ent)
            i += 1
        return scheduled, preempted

    def preempt(self, victim: Entry) -> None:
        pc = clock_ns
        t0 = pc()
        self.coord.free(victim.req.request_id)
        self.t.ns["free"].append(pc() - t0)
        victim.req.num_computed_tokens = 0
        victim.preempted = True
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def admit_waiting(self) -> list[Entry]:
        """Admit waiting requests FCFS up to the concurrency; stop at the first that does not fit."""
        coord, waiting = self.coord, self.waiting
        t = self.t.ns
        pc = clock_ns
        newly: list[Entry] = []
        while waiting and len(self.running) + len(newly) < self.concurrency:
            head = waiting[0]
            ent = head if isinstance(head, Entry) else self.make_entry(head)
            waiting[0] = ent
            req = ent.req
            t0 = pc()
            hit = coord.get_computed_blocks(req)
            t["lookup"].append(pc() - t0)
            t0 = pc()
            ids = coord.allocate_slots(req, req.num_tokens - hit.num_tokens, hit)
            t["prefill_alloc"].append(pc() - t0)
            if ids is None:
                self.admission_failures += 1
                if not self.running and not newly:
                    raise RuntimeError("cannot admit even a single request")
                break
            waiting.popleft()
            self.record_hit(ent, hit.num_tokens)
            req.num_computed_tokens = hit.num_tokens
            newly.append(ent)
        return newly

    def make_entry(self, idx: int) -> Entry:
        p, suffix = self.trace[idx]
        t0 = clock_ns()
        req = CacheRequest(str(idx), self.prefixes[p] + suffix, self.coord.hash_block_size)
        self.t.ns["make_request"].append(clock_ns() - t0)
        return Entry(req, idx)

    def record_hit(self, ent: Entry, num_hit: int) -> None:
        """vLLM's PrefixCacheStats: only admissions of never-preempted requests count."""
        if ent.preempted:
            return
        self.queries += ent.req.num_tokens
        self.hit_tokens += num_hit
        self.hits[ent.idx] = num_hit

    def execute(self, ent: Entry) -> None:
        req = ent.req
        req.num_computed_tokens = req.num_tokens
        req.append_token_ids([(ent.idx * 7 + ent.step + 1) % VOCAB])
        ent.step += 1

    def free_finished(self) -> None:
        pc = clock_ns
        ns = self.t.ns["free"]
        still: list[Entry] = []
        for ent in self.running:
            if ent.step >= DECODE_STEPS:
                t0 = pc()
                self.coord.free(ent.req.request_id)
                ns.append(pc() - t0)
            else:
                still.append(ent)
        self.running = still


# -- kvfleet side -------------------------------------------------------------------------------------
@dataclass
class ConfigResult:
    """Medians over runs of one configuration (kvfleet or vLLM)."""

    mean_us: dict[str, float]
    token_hit_rate: float
    hits: list[int] | None
    preemptions: int


def run_kvfleet_once(
    kind: str,
    concurrency: int,
    retention: RetentionOptions,
    prefixes: list[list[int]],
    trace: Trace,
    check_every: int,
    run: int,
) -> RunResult:
    res = TraceRunner(kind, concurrency, retention, prefixes, trace, check_every).run()
    LOG.info(
        "[kvfleet %s C=%d retention=%s run%d] wall=%.2fs lookup=%.1fus prefill=%.1fus decode=%.2fus "
        "free=%.1fus mkreq=%.1fus hit=%.4f preempt=%d admfail=%d steps=%d endfree=%d",
        kind, concurrency, "on" if retention.enabled else "off", run, res.wall_s,
        *(res.mean_us[c] for c in CALLS), res.make_request_us, res.token_hit_rate,
        res.preemptions, res.admission_failures, res.steps, res.end_free_blocks,
    )  # fmt: skip
    return res


def summarize_kvfleet(label: str, results: list[RunResult]) -> ConfigResult:
    if any(res.hits != results[0].hits for res in results):
        LOG.warning("kvfleet %s: per-request hits differ between runs (the trace is deterministic)", label)
    return ConfigResult(
        mean_us={c: statistics.median(res.mean_us[c] for res in results) for c in CALLS},
        token_hit_rate=statistics.median(res.token_hit_rate for res in results),
        hits=results[0].hits,
        preemptions=results[0].preemptions,
    )


# -- vLLM side ------------------------------------------------------------------------------------------
class VllmAnchor:
    """vLLM's KVCacheManager driven by the anchor's drive.py, one subprocess per run."""

    def __init__(
        self, num_requests: int, anchor_dir: Path = ANCHOR_DIR, venv: Path = ANCHOR_VENV, clock: str = "wall"
    ):
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
                "--kinds", kind,
                "--concurrency", str(concurrency),
                "--runs", "1",
                "--num-requests", str(self.num_requests),
                "--num-prefixes", str(NUM_PREFIXES),
                "--prefix-len", str(PREFIX_LEN),
                "--suffix-len", str(SUFFIX_LEN),
                "--decode-steps", str(DECODE_STEPS),
                "--block-size", str(BLOCK_SIZE),
                "--window", str(WINDOW),
                "--num-blocks", str(NUM_BLOCKS),
                "--seed", str(SEED),
                "--out", out,
            ]  # fmt: skip
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


def compare_config(
    kind: str, concurrency: int, args: argparse.Namespace, prefixes: list[list[int]], trace: Trace,
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
        "lower": sum(1 for a, b in zip(ours, theirs) if a < b),
        "higher": sum(1 for a, b in zip(ours, theirs) if a > b),
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
        "--clock", choices=sorted(CLOCKS), default="wall",
        help="per-call clock on both sides: wall (perf_counter_ns) or cpu (thread_time_ns)",
    )  # fmt: skip
    ap.add_argument(
        "--check-invariants", type=int, default=0, metavar="N",
        help="call coord.check_invariants() every N steps (untimed; 0: never)",
    )  # fmt: skip
    ap.add_argument(
        "--retention-budget", type=int, default=RETENTION.budget_blocks,
        help="budget_blocks of the pinned_hit_rate runs (default: the documented RETENTION, no cap)",
    )  # fmt: skip
    ap.add_argument(
        "--retention-min-drop-blocks", type=int, default=RETENTION.min_drop_blocks,
        help="min_drop_blocks of the pinned_hit_rate runs (default: the documented RETENTION)",
    )  # fmt: skip
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
    clock_ns = CLOCKS[args.clock]
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
