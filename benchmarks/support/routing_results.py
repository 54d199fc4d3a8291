"""What ``benchmarks/routing_sim.py`` measures: per-request records and one run's metrics.

Owns ``Record`` (one request's hit, prediction, TTFT and decision time), ``Result`` (one run's
hit rate, TTFT, imbalance, decision latency, accuracy, lost hits and pinned-prefix hit rate,
after the warm-up or over the whole trace), ``min_decision_p99`` (the decision p99 over
deterministic replays).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.support.stats import percentile


@dataclass
class Record:
    """One request of a run: its hit at admission and at the decision, prediction, TTFT and decision cost."""

    arrival: float
    prefix: int
    num_tokens: int
    hit: int = -1  # at admission on the chosen worker
    hit_at_route: int = -1  # what the chosen worker's coordinator answered when the router decided
    predicted: int = -1
    ttft: float = -1.0
    decision_ns: int = 0  # wall time of route()
    decision_cpu_ns: int = 0  # CPU time of route() (excludes preemption by other processes)
    delayed: bool = False
    worker: str = ""
    best_hit: int = -1  # --diagnose: the best hit any worker's coordinator had at the decision
    best_shared: int = -1  # --diagnose: the deepest cached full-attention prefix on any worker


@dataclass
class Result:
    """One policy's run over one trace: the records, busy times and pin recovery, and the metrics on them."""

    name: str
    workers: int
    ratio: float
    records: list[Record]
    busy: list[float]
    duration: float
    warmup: int
    busy_measured: list[float] = field(default_factory=list)
    warm_time: float = 0.0  # arrival time of the first measured request
    pinned_ranks: set[int] = field(default_factory=set)
    pin_lengths: dict[int, int] = field(default_factory=dict)
    recovery_s: float | None = None
    wall_s: float = 0.0
    num_blocks: int = 0

    def measured(self, whole: bool = False) -> list[Record]:
        """The requests after the warm-up (``whole``: every request of the trace)."""
        return [r for r in self.records[0 if whole else self.warmup :] if r.hit >= 0]

    def hit_rate(self, whole: bool = False) -> float:
        rows = self.measured(whole)
        return sum(r.hit for r in rows) / max(1, sum(r.num_tokens for r in rows))

    def window_hits(self, parts: int = 4) -> list[float]:
        """Hit rate over each of ``parts`` equal slices of the trace (shows when it levels off)."""
        n = len(self.records)
        out = []
        for k in range(parts):
            rows = [r for r in self.records[k * n // parts : (k + 1) * n // parts] if r.hit >= 0]
            out.append(sum(r.hit for r in rows) / max(1, sum(r.num_tokens for r in rows)))
        return out

    def ttft(self, whole: bool = False) -> tuple[float, float]:
        values = sorted(r.ttft for r in self.measured(whole))
        return sum(values) / len(values), percentile(values, 0.9)

    def imbalance(self, whole: bool = False) -> float:
        """max / mean busy time over the workers, after the warm-up (``whole``: the whole run)."""
        busy = self.busy if whole or not self.busy_measured else self.busy_measured
        return max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0

    def decision_us(self, cpu: bool = True) -> tuple[float, float]:
        values = sorted((r.decision_cpu_ns if cpu else r.decision_ns) / 1000 for r in self.records if r.decision_ns)
        return percentile(values, 0.5), percentile(values, 0.99)

    def accuracy(self, at_route: bool = False) -> float | None:
        """Share of requests whose predicted hit equals the hit at admission (``at_route``: the
        chosen worker's hit at the moment of the decision)."""
        rows = [r for r in self.measured() if r.predicted >= 0]
        if not rows:
            return None
        return sum(r.predicted == (r.hit_at_route if at_route else r.hit) for r in rows) / len(rows)

    def lost_hits(self, aligned: dict[int, int]) -> dict[str, float]:
        """Where the shared-prefix tokens not hit went, as shares of all prompt tokens (needs
        ``diagnose``): ``first_use`` (the prefix's first request in the run: no router can hit),
        ``evicted`` (no worker held any of it), ``not_best`` (a worker had a longer hit),
        ``partial`` (no worker had the whole prefix: windows or blocks at its end evicted)."""
        seen: set[int] = set()
        lost = dict.fromkeys(("first_use", "evicted", "not_best", "partial"), 0)
        total = 0
        for i, r in enumerate(self.records):
            measured = i >= self.warmup and r.hit >= 0
            miss = aligned[r.prefix] - r.hit
            if measured:
                total += r.num_tokens
            if measured and miss > 0 and r.best_hit >= 0:
                if r.prefix not in seen:
                    lost["first_use"] += miss
                elif r.best_hit == 0 and r.best_shared == 0:
                    lost["evicted"] += miss
                elif r.hit < r.best_hit:
                    lost["not_best"] += miss
                else:
                    lost["partial"] += miss
            seen.add(r.prefix)
        return {k: round(v / max(1, total), 4) for k, v in lost.items()}

    def delayed(self) -> float:
        """Share of requests not admitted at once (no KV room or max_num_seqs reached)."""
        rows = self.measured()
        return sum(r.delayed for r in rows) / max(1, len(rows))

    def utilisation(self) -> float:
        return sum(self.busy) / (len(self.busy) * self.duration) if self.duration else 0.0

    def prefix_hit_rate(self, ranks: set[int] | None, inside: bool, aligned: dict[int, int]) -> float:
        """Cached share of the shared-prefix tokens, over requests whose prefix is (not) in ``ranks``."""
        hit = total = 0
        for r in self.measured():
            if ranks is not None and (r.prefix in ranks) != inside:
                continue
            length = aligned[r.prefix]
            hit += min(r.hit, length)
            total += length
        return hit / total if total else 0.0


def min_decision_p99(first: Result, replays: list[Result]) -> float:
    """p99 over decisions of each decision's least CPU time across identical runs (the runs are
    deterministic, so record i is the same decision in every one)."""
    runs = [first, *replays]
    placed = [rec.worker for rec in first.records]
    if any([rec.worker for rec in r.records] != placed for r in replays):
        raise RuntimeError("decision replays placed requests differently: the simulation is not deterministic")
    least = [min(r.records[i].decision_cpu_ns for r in runs) / 1000 for i in range(len(first.records))]
    return percentile(sorted(v for v, rec in zip(least, first.records, strict=False) if rec.decision_ns), 0.99)
