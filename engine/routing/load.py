"""Time-averaged queue lengths (the sustained-imbalance guard), decayed assigned work (the work
guard), O(1) per change and per query, and the workers in load order (``LoadOrder``: the least
loaded in O(log W) per change and per query).

Each worker's queued tokens are piecewise constant between load reports and assignments, so the
exponential average with half-life h has a closed form: after a change at time t0 with average
a0 and new value q, the average at t is ``q + (a0 - q) * 0.5 ** ((t - t0) / h)``. The cluster
mean needs no pass over the workers: averaging is linear, so the average of the sum of the
queues (tracked the same way) divided by the number of workers is the mean of the averages.

``LoadBook`` bundles the three for the policy with the per-worker queued tokens and load costs,
the pick's loop over a request's candidates and the whole-pool pick and record;
``PyLoadBook`` is the reference, ``engine/routing/_load.c`` the compiled book (built at install
time, optional like the holder maps' core).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Container
from heapq import heapify, heappop, heappush
from itertools import count
from typing import NamedTuple, Protocol

from configs.schema import RouterConfig, RouterWeights
from engine.routing.decay import decayed
from engine.routing.holder_maps import compiled_core
from engine.routing.types import Decision, WorkerId, WorkerLoad


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
        now = self.now if now is None or now < self.now else now
        self.now = now
        total = self._total
        halflife = self.halflife_s
        total.set(total.value + queued - state.value, now, halflife)
        state.set(queued, now, halflife)

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
        return decayed(state[0], state[1], now, self.halflife_s)

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

    def rank(self, worker: WorkerId) -> float:
        """A key that orders workers by their work at any common time: every value decays by the
        same factor, so ``log2(value) + at / halflife`` compares like the values (-inf: none)."""
        value, at = self._workers[worker]
        return math.log2(value) + at / self.halflife_s if value > 0 else -math.inf

    def mean(self, now: float) -> float:
        return self._at(self._total, now) / max(1, len(self._workers))


class LoadOrder:
    """Every worker keyed by (load cost, ``DecayedWork.rank``, a seeded random draw), in a heap.

    ``set`` records a worker's key (a new heap entry; the old one goes stale), ``first`` returns
    the least worker not excluded and not guarded, looking at a bounded number of the smallest
    entries. Invariants: ``_entry[w]`` is worker w's live entry and is in the heap; an entry that
    is not some worker's live entry is stale and is skipped (the heap is rebuilt from the live
    entries once stale ones outnumber them three to one). The random draw, made at each ``set``,
    breaks exact ties (idle workers with no work yet) at random.
    """

    def __init__(self, seed: int = 0):
        self._heap: list[tuple[float, float, float, int, WorkerId]] = []
        self._entry: dict[WorkerId, tuple[float, float, float, int, WorkerId]] = {}
        self._rng = random.Random(seed)
        self._counter = count()

    def __len__(self) -> int:
        return len(self._entry)

    def set(self, worker: WorkerId, cost: float, work_rank: float) -> None:
        old = self._entry.get(worker)
        if old is not None and old[0] == cost and old[1] == work_rank:
            return
        entry = (cost, work_rank, self._rng.random(), next(self._counter), worker)
        self._entry[worker] = entry
        heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._entry) + 64:
            self._heap = list(self._entry.values())
            heapify(self._heap)

    def remove(self, worker: WorkerId) -> None:
        self._entry.pop(worker, None)

    def first(
        self, exclude: Container[WorkerId], ok: Callable[[WorkerId], bool], probes: int
    ) -> tuple[WorkerId | None, bool]:
        """The least worker not in ``exclude`` that ``ok`` accepts, among the ``probes`` smallest
        live entries (None if none is), and whether a smaller one was refused by ``ok``."""
        heap = self._heap
        live = self._entry
        taken: list[tuple[float, float, float, int, WorkerId]] = []
        found: WorkerId | None = None
        refused = False
        while heap and len(taken) < probes:
            entry = heappop(heap)
            worker = entry[4]
            if live.get(worker) is not entry:
                continue  # stale
            taken.append(entry)
            if worker in exclude:
                continue
            if not ok(worker):
                refused = True
                continue
            found = worker
            break
        for entry in taken:
            heappush(heap, entry)
        return found, refused


#: entries of the load order looked at beyond a request's prefix holders before the pick falls
#: back to a pass over every worker (the least loaded are all guarded: rare)
LEAST_LOADED_PROBES = 8


class Knobs(NamedTuple):
    """What a load book is built with: ``RouterConfig``'s half-lives, guard ratios, anchor credit,
    load weights and the weights pricing a host-tier hit, the load order's seed (``knobs_of``) and
    the load order's extra probes."""

    load_halflife_s: float
    work_halflife_s: float
    seed: int
    imbalance_ratio: float
    imbalance_slack_tokens: float
    sustained_imbalance_ratio: float
    work_imbalance_ratio: float
    request_work_tokens: float
    anchor_credit: float
    w_queued: float  # ``RouterWeights``: a worker's load cost per queued token,
    w_running: float  # per running request,
    w_used: float  # per used share of its blocks (``LoadBook.report``);
    promote_seconds: float  # the weight of a host-tier hit token's promote time (``LoadBook.promote_load``)
    w_miss: float  # an uncached token's weight, ``miss_weight``
    extra_probes: int = LEAST_LOADED_PROBES


def miss_weight(weights: RouterWeights) -> float:
    """The weight of an uncached prefill token: its compute plus the cache churn it causes."""
    return weights.uncached_tokens + weights.cache_churn


def knobs_of(config: RouterConfig) -> Knobs:
    return Knobs(
        config.load_halflife_s,
        config.work_halflife_s,
        config.seed,
        config.imbalance_ratio,
        config.imbalance_slack_tokens,
        config.sustained_imbalance_ratio,
        config.work_imbalance_ratio,
        config.request_work_tokens,
        config.anchor_credit,
        config.weights.queued_tokens,
        config.weights.running_requests,
        config.weights.used_block_fraction,
        config.weights.promote_seconds,
        miss_weight(config.weights),
    )


#: what ``LoadBook.scan`` returns: (best cost, the workers at it, the pending holders left for the
#: caller to resolve, the holders costed at the spread weight, whether a guard refused a worker,
#: whether the load order gave a least loaded worker without a prefix)
Scan = tuple[float, list[WorkerId], list[WorkerId], set[WorkerId], bool, bool]


class LoadBook(Protocol):
    """The routing policy's load state: each worker's queued tokens (``queued``, and their sum
    ``queued_sum``) and load cost (``load_cost``: the one place it is computed, ``report``), read
    by the policy and changed only here; queued tokens averaged over time (``SmoothedQueues``,
    absent when ``load_halflife_s`` is 0), work assigned lately (``DecayedWork``) and the load order
    (``LoadOrder``); the pick's loop over a request's candidates (``scan``) and the whole-pool pick
    and record (``choose``, ``assign``, ``place``).

    Built over the router's load copies (``PlacementPolicy.loads``, which ``assign`` updates) and
    the policy's seeded ``randrange`` (ties). Two implementations with identical results (the same
    floating-point operations in the same order, the same random draws): ``PyLoadBook`` below,
    the reference, and the compiled ``engine.routing._load.LoadBook`` (``make_load_book`` picks one
    like ``holder_maps.make_holder_maps``)."""

    @property
    def load_cost(self) -> dict[WorkerId, float]: ...
    @property
    def queued(self) -> dict[WorkerId, float]: ...
    @property
    def queued_sum(self) -> float: ...
    def add(self, worker: WorkerId) -> None: ...
    def remove(self, worker: WorkerId) -> None: ...
    def advance(self, now: float) -> None: ...
    def report(self, worker: WorkerId, load: WorkerLoad) -> None: ...
    def add_work(self, worker: WorkerId, amount: float, now: float) -> None: ...
    def smoothed(self, worker: WorkerId, now: float) -> float: ...
    def smoothed_mean(self, now: float) -> float: ...
    def work(self, worker: WorkerId, now: float) -> float: ...
    def work_mean(self, now: float) -> float: ...
    def over(self, worker: WorkerId, now: float, slow: float, cap: float) -> bool: ...
    def promote_load(self, worker: WorkerId) -> float: ...
    def thresholds(
        self,
        num_tokens: int,
        now: float,
        mean_queued: float | None,
        mean_smoothed: float | None,
        mean_work: float | None,
    ) -> tuple[float, float, float]: ...
    def credit(
        self,
        hits: dict[WorkerId, int],
        shared: dict[WorkerId, int] | None,
        host: dict[WorkerId, int] | None,
        ahead: dict[WorkerId, int] | None,
    ) -> dict[WorkerId, float]: ...
    def scan(
        self,
        credit: dict[WorkerId, float],
        among: Container[WorkerId],
        limit: float,
        now: float,
        slow: float,
        cap: float,
        w_uncached: float,
        w_spread: float,
        pending: Container[WorkerId],
        probes: int,
    ) -> Scan: ...
    def choose(
        self,
        hits: dict[WorkerId, int],
        shared: dict[WorkerId, int] | None,
        host: dict[WorkerId, int] | None,
        ahead: dict[WorkerId, int] | None,
        pending: Container[WorkerId],
        num_tokens: int,
        now: float,
        w_uncached: float,
        w_spread: float,
        guard: bool = True,
    ) -> tuple[WorkerId, str] | None: ...
    def assign(self, worker: WorkerId, uncached: int, now: float) -> None: ...
    def place(
        self,
        hits: dict[WorkerId, int],
        shared: dict[WorkerId, int] | None,
        host: dict[WorkerId, int] | None,
        ahead: dict[WorkerId, int] | None,
        pending: Container[WorkerId],
        num_tokens: int,
        now: float,
        w_uncached: float,
        w_spread: float,
        guard: bool = True,
    ) -> Decision | None: ...


class PyLoadBook:
    """``LoadBook`` in Python: the per-worker ``queued`` and ``load_cost`` dicts, a
    ``SmoothedQueues`` (None when ``load_halflife_s`` is 0), a ``DecayedWork`` and a ``LoadOrder``
    over the same workers.

    Invariants: all of them track exactly the workers added and not removed; ``queued[w]`` is
    ``loads[w].queued_tokens`` as last reported or assigned and ``queued_sum`` their sum; a
    worker's load-order key is its last load cost and its work rank at that moment."""

    def __init__(self, knobs: Knobs, loads: dict[WorkerId, WorkerLoad], randrange: Callable[[int], int]):
        self.knobs = knobs
        self.loads = loads  # the router's load copies, owned by the policy; ``assign`` updates them
        self.randrange = randrange
        self.load_cost: dict[WorkerId, float] = {}
        self.queued: dict[WorkerId, float] = {}
        self.queued_sum = 0.0
        self.queues = SmoothedQueues(knobs.load_halflife_s) if knobs.load_halflife_s > 0 else None
        self.assigned = DecayedWork(knobs.work_halflife_s)
        self.order = LoadOrder(knobs.seed)

    def add(self, worker: WorkerId) -> None:
        """Track ``worker``: queue and work 0, load cost 0."""
        if worker in self.queued:
            raise ValueError(f"worker {worker!r} is already in the load book")
        self.load_cost[worker] = 0.0
        self.queued[worker] = 0.0
        if self.queues is not None:
            self.queues.add(worker)
        self.assigned.add_worker(worker)
        self.order.set(worker, 0.0, self.assigned.rank(worker))

    def remove(self, worker: WorkerId) -> None:
        """Forget ``worker`` (an unknown one is ignored)."""
        if worker not in self.queued:
            return
        self.queued_sum -= self.queued.pop(worker)
        del self.load_cost[worker]
        self.order.remove(worker)
        if self.queues is not None:
            self.queues.remove(worker)
        self.assigned.remove(worker)

    def advance(self, now: float) -> None:
        """The time of a decision: later queue changes reported without a time happen then."""
        if self.queues is not None:
            self.queues.now = max(self.queues.now, now)

    def report(self, worker: WorkerId, load: WorkerLoad) -> None:
        """``load`` is ``worker``'s load now (its report, or the router's copy after an
        assignment): its queued tokens, and its load cost ``w_queued * queued_tokens + w_running *
        running_requests + w_used * used_block_fraction``, go into the dicts, the queue average and
        the load order."""
        knobs = self.knobs
        queued = load.queued_tokens
        cost = (
            knobs.w_queued * queued + knobs.w_running * load.running_requests + knobs.w_used * load.used_block_fraction
        )
        self.queued_sum += queued - self.queued[worker]
        self.queued[worker] = queued
        self.load_cost[worker] = cost
        if self.queues is not None:
            self.queues.set(worker, queued)
        self.order.set(worker, cost, self.assigned.rank(worker))

    def add_work(self, worker: WorkerId, amount: float, now: float) -> None:
        self.assigned.add(worker, amount, now)

    def smoothed(self, worker: WorkerId, now: float) -> float:
        return self.queues.get(worker, now) if self.queues is not None else 0.0

    def smoothed_mean(self, now: float) -> float:
        return self.queues.mean(now) if self.queues is not None else 0.0

    def work(self, worker: WorkerId, now: float) -> float:
        return self.assigned.get(worker, now)

    def work_mean(self, now: float) -> float:
        return self.assigned.mean(now)

    def over(self, worker: WorkerId, now: float, slow: float, cap: float) -> bool:
        """Whether ``worker`` took more than its share lately: its time-averaged queue above
        ``slow`` or its assigned work above ``cap`` (``thresholds`` sets both)."""
        return (self.queues is not None and self.queues.get(worker, now) > slow) or self.assigned.get(worker, now) > cap

    def promote_load(self, worker: WorkerId) -> float:
        """What a host-tier hit token on ``worker`` costs, as a share of a miss's cost: a host-tier
        hit is not recomputed but copied back to the device, so it costs the seconds that copy
        takes (``WorkerLoad.promote_s_per_token`` in its load copy, measured by the worker)
        weighted by ``promote_seconds`` (prefill tokens per second), over ``w_miss``; at most 1
        (never above a recompute), 0 for a worker without a load copy or a promote cost."""
        load = self.loads.get(worker)
        if load is None or load.promote_s_per_token <= 0:
            return 0.0
        knobs = self.knobs
        return min(1.0, knobs.promote_seconds * load.promote_s_per_token / max(knobs.w_miss, 1e-9))

    def thresholds(
        self,
        num_tokens: int,
        now: float,
        mean_queued: float | None,
        mean_smoothed: float | None,
        mean_work: float | None,
    ) -> tuple[float, float, float]:
        """The guards' thresholds for a request of ``num_tokens`` against its pool's means (the
        mean queue, the mean time-averaged queue and the mean recent work; None: the book's own,
        over every worker), as (``limit``, ``slow``, ``cap``): a worker may take the request while
        its queued tokens are at most ``limit``; a prefix holder is over its share (``over``) when
        its time-averaged queue exceeds ``slow`` or its work assigned lately exceeds ``cap``.

        ``limit``: ``imbalance_ratio`` times the mean queue plus this request and
        ``imbalance_slack_tokens`` (at moderate load a burst should not copy a prefix to a second
        worker). ``slow``: ``sustained_imbalance_ratio`` times the mean time-averaged queue
        (half-life ``load_halflife_s``) plus this request. ``cap``: ``work_imbalance_ratio`` times
        the mean work assigned lately (uncached tokens plus ``request_work_tokens`` per request,
        half-life ``work_halflife_s``) plus this request's: busy time follows that work. A check
        that is off (half-life 0, ratio 0) has an infinite threshold."""
        knobs = self.knobs
        if mean_queued is None:
            mean_queued = self.queued_sum / max(1, len(self.queued))
        limit = knobs.imbalance_ratio * mean_queued + num_tokens + knobs.imbalance_slack_tokens
        slow = math.inf
        if self.queues is not None:
            mean = self.queues.mean(now) if mean_smoothed is None else mean_smoothed
            slow = knobs.sustained_imbalance_ratio * mean + num_tokens
        cap = math.inf
        if knobs.work_imbalance_ratio:
            mean = self.assigned.mean(now) if mean_work is None else mean_work
            cap = knobs.work_imbalance_ratio * mean + num_tokens + knobs.request_work_tokens
        return limit, slow, cap

    def credit(
        self,
        hits: dict[WorkerId, int],
        shared: dict[WorkerId, int] | None,
        host: dict[WorkerId, int] | None,
        ahead: dict[WorkerId, int] | None,
    ) -> dict[WorkerId, float]:
        """Tokens each worker with a prefix saves: its hit (``hits``), plus ``anchor_credit`` of
        the part of its full-attention depth (``shared``) that a group cannot serve (running there
        anchors that depth), less the load time of the part its host tier serves (``host``: those
        tokens times ``promote_load``, the one place a host-tier hit is priced), raised to the
        tokens routed to it and not yet reported (``ahead``) where those are more. Keys in the
        order hits, shared, ahead."""
        credit: dict[WorkerId, float] = dict(hits)
        if shared:
            c = self.knobs.anchor_credit
            for worker, depth in shared.items():
                hit = hits.get(worker, 0)
                credit[worker] = hit + c * (depth - hit)
        if host:
            for worker, tokens in host.items():
                if worker in credit:
                    credit[worker] -= tokens * self.promote_load(worker)
        if ahead:
            for worker, tokens in ahead.items():
                if tokens > credit.get(worker, 0):
                    credit[worker] = tokens
        return credit

    def scan(
        self,
        credit: dict[WorkerId, float],
        among: Container[WorkerId],
        limit: float,
        now: float,
        slow: float,
        cap: float,
        w_uncached: float,
        w_spread: float,
        pending: Container[WorkerId],
        probes: int,
    ) -> Scan:
        """The pick's argmin over the workers with a prefix (``credit``: tokens each saves) that
        are in ``among``, then, when ``probes`` >= 0, over the least loaded worker without one
        (the load order's first ``probes`` entries); ``RoutingPolicy._pick`` states the rule.

        A worker whose queue exceeds ``limit`` is left out (guarded); a holder over its share
        (``over``) is costed at ``w_spread`` instead of ``w_uncached``; a holder in ``pending``
        is deferred to the caller. Cost of a holder: ``load_cost - weight * credit``; of a worker
        without a prefix: its load cost. Ties within 1e-9 are all kept."""
        load_cost = self.load_cost
        queued = self.queued
        best_cost = math.inf
        best: list[WorkerId] = []
        deferred: list[WorkerId] = []
        spread: set[WorkerId] = set()
        guarded = False
        for worker, value in credit.items():
            if worker not in among:
                continue
            if not queued[worker] <= limit:
                guarded = True
                continue
            weight = w_uncached
            if w_spread < w_uncached and value > 0 and self.over(worker, now, slow, cap):
                spread.add(worker)
                weight = w_spread
            if worker in pending:
                deferred.append(worker)
                continue
            best_cost, best = better(worker, load_cost[worker] - weight * value, best_cost, best)
        if probes < 0:
            return best_cost, best, deferred, spread, guarded, False
        fresh, refused = self.order.first(credit, lambda w: queued[w] <= limit, probes)
        if fresh is None:
            return best_cost, best, deferred, spread, guarded or refused, False
        rest = load_cost[fresh]
        if rest < best_cost - 1e-9:
            best_cost, best = rest, [fresh]
        elif rest <= best_cost + 1e-9:
            best = [*best, fresh]
        return best_cost, best, deferred, spread, guarded or refused, True

    def choose(
        self,
        hits: dict[WorkerId, int],
        shared: dict[WorkerId, int] | None,
        host: dict[WorkerId, int] | None,
        ahead: dict[WorkerId, int] | None,
        pending: Container[WorkerId],
        num_tokens: int,
        now: float,
        w_uncached: float,
        w_spread: float,
        guard: bool = True,
    ) -> tuple[WorkerId, str] | None:
        """The pick over the whole pool for a request without a pin, when the book alone can make
        it: the thresholds against every worker's means, the credit (``host``: each worker's
        host-tier part of its hit, which ``credit`` prices), ``scan`` with the holders and
        ``extra_probes`` entries of the load order, a seeded draw among ties and the reason
        (``reason_of``). None, having changed nothing (no draw made), where the pick needs more
        than the book holds: a pending holder to resolve against the index, or no allowed worker
        without a prefix among the load order's first entries (``_pick`` then makes the general
        pick, with the same rule). ``guard`` False: no worker is left out for its queue (the
        instantaneous guard's limit is infinite; ``RoutingPolicy._pick``'s ``guard``)."""
        limit, slow, cap = self.thresholds(num_tokens, now, None, None, None)
        if not guard:
            limit = math.inf
        credit = self.credit(hits, shared, host, ahead)
        probes = len(credit) + self.knobs.extra_probes
        load_cost = self.load_cost
        _, best, deferred, spread, guarded, fresh = self.scan(
            credit, load_cost, limit, now, slow, cap, w_uncached, w_spread, pending, probes
        )
        if deferred or not fresh or not best:
            return None
        choice = best[0] if len(best) == 1 else best[self.randrange(len(best))]
        return choice, reason_of(choice, hits, ahead, guarded, spread)

    def assign(self, worker: WorkerId, uncached: int, now: float) -> None:
        """Record a request running whole on ``worker`` with ``uncached`` tokens to compute: its
        work (plus ``request_work_tokens``), then the router's load copy (the tokens queued, one
        more running request) reported to the book."""
        load = self.loads[worker]
        self.add_work(worker, uncached + self.knobs.request_work_tokens, now)
        load.queued_tokens += uncached
        load.running_requests += 1
        self.report(worker, load)

    def place(
        self,
        hits: dict[WorkerId, int],
        shared: dict[WorkerId, int] | None,
        host: dict[WorkerId, int] | None,
        ahead: dict[WorkerId, int] | None,
        pending: Container[WorkerId],
        num_tokens: int,
        now: float,
        w_uncached: float,
        w_spread: float,
        guard: bool = True,
    ) -> Decision | None:
        """``choose``, then ``assign`` of the request to the chosen worker (its uncached tokens:
        ``num_tokens`` less its hit): the ``Decision`` (the worker both ways, its hit, the reason,
        no pin, best hit ``max(hits.values(), default=0)``, the worker's host-tier part of its hit
        from ``host``), or None where ``choose`` gives None."""
        chosen = self.choose(hits, shared, host, ahead, pending, num_tokens, now, w_uncached, w_spread, guard)
        if chosen is None:
            return None
        worker, reason = chosen
        hit = hits.get(worker, 0)
        self.assign(worker, num_tokens - hit, now)
        best = max(hits.values(), default=0)
        return Decision(worker, worker, hit, num_tokens, reason, None, 0, best, host.get(worker, 0) if host else 0)


def reason_of(
    choice: WorkerId,
    hits: dict[WorkerId, int],
    ahead: dict[WorkerId, int] | None,
    guarded: bool,
    spread: set[WorkerId],
) -> str:
    """Why a cost pick chose ``choice``: "guard" when a guard refused a worker or priced a holder
    over its share, ``choice`` is not such a holder and its predicted hit is below the best one
    (the guard moved the request off a longer hit); "prefix" when it holds a hit; "inflight" when
    part of the prompt was routed to it and not yet reported; "cost" otherwise."""
    hit = hits.get(choice, 0)
    if (guarded or spread) and choice not in spread and hit < max(hits.values(), default=0):
        return "guard"
    if hit > 0:
        return "prefix"
    if ahead and ahead.get(choice, 0) > 0:
        return "inflight"
    return "cost"


def better(worker: WorkerId, cost: float, best_cost: float, best: list[WorkerId]) -> tuple[float, list[WorkerId]]:
    """Fold one (worker, cost) into a running argmin (ties within 1e-9 kept for a random pick)."""
    if cost < best_cost - 1e-9:
        return cost, [worker]
    if cost <= best_cost + 1e-9:
        best.append(worker)
    return best_cost, best


def make_load_book(
    knobs: Knobs, loads: dict[WorkerId, WorkerLoad], randrange: Callable[[int], int], core: str | None = None
) -> LoadBook:
    """The load book over the router's load copies ``loads`` with tie draws from ``randrange``,
    compiled or not as ``holder_maps.compiled_core`` says (``KVFLEET_ROUTING_CORE`` by default, the
    variable that picks the holder maps)."""
    compiled = compiled_core("_load", "LoadBook", core)
    if compiled is None:
        return PyLoadBook(knobs, loads, randrange)
    book: LoadBook = compiled(*knobs, loads, randrange)
    return book
