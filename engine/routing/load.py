"""Time-averaged queue lengths (the sustained-imbalance guard) and decayed assigned work (the work
guard), O(1) per change and per query.

Each worker's queued tokens are piecewise constant between load reports and assignments, so the
exponential average with half-life h has a closed form: after a change at time t0 with average
a0 and new value q, the average at t is ``q + (a0 - q) * 0.5 ** ((t - t0) / h)``. The cluster
mean needs no pass over the workers: averaging is linear, so the average of the sum of the
queues (tracked the same way) divided by the number of workers is the mean of the averages.
"""

from __future__ import annotations

from engine.routing.types import WorkerId


class _Average:
    """One exponentially averaged piecewise-constant value."""

    __slots__ = ("at", "avg", "value")

    def __init__(self, at: float):
        self.value = 0.0
        self.avg = 0.0
        self.at = at

    def get(self, now: float, halflife: float) -> float:
        if now <= self.at:
            return self.avg
        return self.value + (self.avg - self.value) * 0.5 ** ((now - self.at) / halflife)

    def set(self, value: float, now: float, halflife: float) -> None:
        self.avg = self.get(now, halflife)
        self.at = max(self.at, now)
        self.value = value


class SmoothedQueues:
    """Per worker and in total: queued tokens averaged over time (half-life ``halflife_s``).

    ``set(worker, queued, now)`` records a new queue length; ``get``/``mean`` read the averages at
    ``now``. A worker's average starts at 0 when it is added.
    """

    def __init__(self, halflife_s: float):
        if halflife_s <= 0:
            raise ValueError(f"load_halflife_s: must be > 0 (got {halflife_s})")
        self.halflife_s = halflife_s
        self._workers: dict[WorkerId, _Average] = {}
        self._total = _Average(0.0)
        self.now = 0.0  # the latest time seen (changes reported without a time happen then)

    def add(self, worker: WorkerId) -> None:
        self._workers[worker] = _Average(self.now)

    def remove(self, worker: WorkerId) -> None:
        state = self._workers.pop(worker, None)
        if state is not None:
            self._total.set(self._total.value - state.value, self.now, self.halflife_s)
            self._total.avg -= state.get(self.now, self.halflife_s)

    def set(self, worker: WorkerId, queued: float, now: float | None = None) -> None:
        state = self._workers.get(worker)
        if state is None:
            return
        now = self.now if now is None else max(now, self.now)
        self.now = now
        total = self._total
        total.set(total.value + queued - state.value, now, self.halflife_s)
        state.set(queued, now, self.halflife_s)

    def get(self, worker: WorkerId, now: float) -> float:
        return self._workers[worker].get(now, self.halflife_s)

    def mean(self, now: float) -> float:
        return self._total.get(now, self.halflife_s) / max(1, len(self._workers))


class DecayedWork:
    """Per worker and in total: work assigned lately, each amount decaying with half-life
    ``halflife_s`` (a rate estimate: about ``rate * halflife_s / ln 2`` in steady state).

    Every worker's value decays by the same factor, so comparing two workers, or one worker with
    the mean, needs no pass over the others; ``add`` and ``get`` are O(1).
    """

    def __init__(self, halflife_s: float):
        if halflife_s <= 0:
            raise ValueError(f"work_halflife_s: must be > 0 (got {halflife_s})")
        self.halflife_s = halflife_s
        self._workers: dict[WorkerId, list[float]] = {}  # worker -> [value, at]
        self._total = [0.0, 0.0]
        self.now = 0.0

    def _at(self, state: list[float], now: float) -> float:
        if now <= state[1]:
            return state[0]
        return state[0] * 0.5 ** ((now - state[1]) / self.halflife_s)

    def add_worker(self, worker: WorkerId) -> None:
        self._workers[worker] = [0.0, self.now]

    def remove(self, worker: WorkerId) -> None:
        state = self._workers.pop(worker, None)
        if state is not None:
            self._total = [max(0.0, self._at(self._total, self.now) - self._at(state, self.now)), self.now]

    def add(self, worker: WorkerId, amount: float, now: float) -> None:
        state = self._workers.get(worker)
        if state is None:
            return
        now = max(now, self.now)
        self.now = now
        state[0], state[1] = self._at(state, now) + amount, now
        total = self._total
        total[0], total[1] = self._at(total, now) + amount, now

    def get(self, worker: WorkerId, now: float) -> float:
        return self._at(self._workers[worker], now)

    def mean(self, now: float) -> float:
        return self._at(self._total, now) / max(1, len(self._workers))
