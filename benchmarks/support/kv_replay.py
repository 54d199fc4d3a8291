"""kvfleet's side of ``benchmarks/kv_cache_vs_vllm.py``: drive.py's scheduling loop replayed on a
``HybridCoordinator``.

Owns the per-call clock (``CLOCKS``; ``clock_ns`` is the one the runner reads: the script's
``main`` sets it here for ``--clock``), the replay itself (``TraceRunner`` with its ``Entry``,
``Timings`` and ``RunResult``), one logged run (``run_kvfleet_once``) and the medians over runs
(``ConfigResult``, ``summarize_kvfleet``).
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass

from benchmarks.support.kv_trace import CALLS, DECODE_STEPS, NUM_BLOCKS, VOCAB, Trace, make_groups
from engine.kv_cache import (
    CacheRequest,
    HybridCoordinator,
    RetentionOptions,
)

LOG = logging.getLogger("kv_cache_vs_vllm")

# The per-call clock (``--clock``): wall time by default, or the calling thread's CPU time.
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
clock_ns = CLOCKS["wall"]


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
    """One kvfleet run of one configuration: per-call means and counts, hits and scheduler totals."""

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
        kind,
        concurrency,
        "on" if retention.enabled else "off",
        run,
        res.wall_s,
        *(res.mean_us[c] for c in CALLS),
        res.make_request_us,
        res.token_hit_rate,
        res.preemptions,
        res.admission_failures,
        res.steps,
        res.end_free_blocks,
    )
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
