"""The argmin of kvfleet's routing policy: credits, guards and the cost comparison.

A mixin of ``engine.routing.policy.RoutingPolicy`` (split out of it, not used alone); the cost
terms and why they are what they are: that module's docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from configs.schema import RouterConfig
from engine.routing.index import Pending
from engine.routing.load import DecayedWork, SmoothedQueues
from engine.routing.pins import Pin
from engine.routing.types import WorkerId


class CostChoice:
    """Chooses one worker by cost for ``RoutingPolicy`` (reads the policy's loads, averages and
    index; changes nothing but the ``pending`` hits it resolves and the seeded random state)."""

    config: RouterConfig
    weights: Any
    index: Any
    rules: Any
    rng: Any
    _load_cost: dict[WorkerId, float]
    _queued: dict[WorkerId, float]
    _queued_sum: float
    _smoothed: SmoothedQueues | None
    _work: DecayedWork
    _now: float

    def _pick(
        self,
        workers: list[WorkerId],
        hits: dict[WorkerId, int],
        num_tokens: int,
        pin: Pin | None,
        w_uncached: float,
        shared: dict[WorkerId, int] | None = None,
        pending: Pending | None = None,
        ahead: dict[WorkerId, int] | None = None,
    ) -> tuple[WorkerId, str]:
        """argmin cost over the workers the guards let through (pin holders first).

        The guards (``_guard``): a worker whose queue is far above the pool's mean is left out; a
        worker holding the prefix that has taken more than its share lately (``over``) keeps its
        credit at the compute weight only (``w_spread``: ``self.weights.uncached_tokens``, without the churn
        term), so the prefix spreads to another worker only where the holder's load costs more
        than recomputing the prefix there. This is the one place that rule is applied.

        Only workers with a prefix (a hit or a full-attention depth) are costed one by one; every
        other worker costs its load alone, so the best of those is a C-level ``min``. ``pending``
        workers (hit below their full-attention depth, not yet resolved) are first costed with
        the best hit they could have (one aligned step below that depth); only those whose bound
        could beat (or tie) the best cost are resolved exactly, so the result equals the fully
        resolved one. ``ahead``: tokens of the prompt routed to a worker and not yet reported
        (credited where they exceed what the index knows; the caller resolves ``pending`` first)."""
        load_cost = self._load_cost
        among = load_cost if len(workers) == len(load_cost) else set(workers)
        ok, over = self._guard(num_tokens, workers)
        credit = self._credit(hits, shared)
        if ahead:
            for worker, tokens in ahead.items():
                if tokens > credit.get(worker, 0):
                    credit[worker] = tokens
        reason = "cost"
        if pin is not None:
            resident = [w for w, h in hits.items() if h >= pin.length and w in among and ok(w) and not over(w)]
            if resident:
                credit = {w: credit[w] for w in resident}
                reason = "pin"
        w_spread = min(w_uncached, self.weights.uncached_tokens)
        spread: set[WorkerId] = set()  # holders over their share: credit at w_spread
        best_cost = float("inf")
        best: list[WorkerId] = []
        deferred: list[WorkerId] = []
        guarded = False
        pending_mask = pending.workers if pending is not None else 0
        for worker, value in credit.items():
            if worker not in among:
                continue
            if not ok(worker):
                guarded = True
                continue
            weight = w_uncached
            if w_spread < w_uncached and value > 0 and over(worker):
                spread.add(worker)
                weight = w_spread
            if pending_mask and self.index.bit(worker) & pending_mask:
                deferred.append(worker)
                continue
            best_cost, best = _better(worker, load_cost[worker] - weight * value, best_cost, best)
        if reason != "pin":  # workers without any prefix: their load cost alone (a C-level min)
            rest = min(map(load_cost.__getitem__, workers))
            if rest <= best_cost + 1e-9:
                ties = [w for w in workers if load_cost[w] <= rest + 1e-9 and w not in credit]
                if ties and rest < best_cost - 1e-9:  # no prefix worker competes: one tie
                    pick = ties[0] if len(ties) == 1 else self._least_worked(ties)
                    allowed = [pick] if ok(pick) else [w for w in ties if ok(w)]
                else:
                    allowed = [w for w in ties if ok(w)]
                if ties and not allowed:  # the least loaded are guarded (rare): every worker
                    guarded = True
                    allowed = [w for w in workers if w not in credit and ok(w)]
                    rest = min(map(load_cost.__getitem__, allowed), default=rest)
                    allowed = [w for w in allowed if load_cost[w] <= rest + 1e-9]
                if allowed and rest <= best_cost + 1e-9:
                    best = best + allowed if rest >= best_cost - 1e-9 else allowed
                    best_cost = min(best_cost, rest)
        if deferred:
            weights = {w: w_spread if w in spread else w_uncached for w in deferred}
            best_cost, best = self._resolve_deferred(deferred, pending, hits, shared, weights, best_cost, best)
        if not best:  # every candidate guarded (possible only for a subset of the workers)
            return min(workers, key=lambda w: load_cost[w] - w_uncached * hits.get(w, 0)), "guard"
        choice = best[0] if len(best) == 1 else best[self.rng.randrange(len(best))]
        if reason == "cost":
            if (guarded or spread) and choice not in spread:
                reason = "guard"
            elif hits.get(choice, 0) > 0:
                reason = "prefix"
            elif ahead and ahead.get(choice, 0) > 0:
                reason = "inflight"
        return choice, reason

    def _least_worked(self, ties: list[WorkerId]) -> WorkerId:
        """Among equally loaded workers without the prefix, the one assigned the least work lately
        (a new prefix goes where the others are not: idle workers look alike, and a worker that
        already took most recent work holds most prefixes, so another one there evicts them);
        equal work is broken at random (seeded)."""
        now = self._now
        work = {w: self._work.get(w, now) for w in ties}
        least = min(work.values())
        ties = [w for w in ties if work[w] <= least + 1e-6]
        return ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]

    def _guard(
        self, num_tokens: int, workers: list[WorkerId]
    ) -> tuple[Callable[[WorkerId], bool], Callable[[WorkerId], bool]]:
        """The guards, as (``ok``: may take the request, ``over``: a prefix holder over its share),
        each against the mean of ``workers`` (the pool the request is placed in: with dedicated
        prefill and decode workers, the other role's load says nothing about this pool's balance).

        ``ok`` fails when a worker's queued tokens exceed ``imbalance_ratio`` times the mean plus
        this request and ``imbalance_slack_tokens`` (at moderate load a burst should not copy a
        prefix to a second worker). ``over`` holds when the worker's queue averaged over the last
        seconds (half-life ``load_halflife_s``) exceeds ``sustained_imbalance_ratio`` times the
        mean average (plus this request), or when the work assigned to it lately (uncached tokens
        plus ``request_work_tokens`` per request, half-life ``work_halflife_s``) exceeds
        ``work_imbalance_ratio`` times the mean (plus this request's): busy time follows that work.
        What ``over`` does is ``_pick``'s rule (the holder's credit at the compute weight)."""
        queued = self._queued
        whole = len(workers) == len(queued)
        count = max(1, len(workers))
        now = self._now
        mean_queued = self._queued_sum / max(1, len(queued)) if whole else sum(map(queued.__getitem__, workers)) / count
        limit = self.config.imbalance_ratio * mean_queued + num_tokens + self.config.imbalance_slack_tokens
        smoothed = self._smoothed
        slow = 0.0
        if smoothed is not None:
            mean = smoothed.mean(now) if whole else sum(smoothed.get(w, now) for w in workers) / count
            slow = self.config.sustained_imbalance_ratio * mean + num_tokens
        work = self._work if self.config.work_imbalance_ratio else None
        cap = 0.0
        if work is not None:
            mean = work.mean(now) if whole else sum(work.get(w, now) for w in workers) / count
            cap = self.config.work_imbalance_ratio * mean + num_tokens + self.config.request_work_tokens

        def ok(worker: WorkerId) -> bool:
            return queued[worker] <= limit

        def over(worker: WorkerId) -> bool:
            return (smoothed is not None and smoothed.get(worker, now) > slow) or (
                work is not None and work.get(worker, now) > cap
            )

        return ok, over

    def _credit(self, hits: dict[WorkerId, int], shared: dict[WorkerId, int] | None) -> dict[WorkerId, float]:
        """Tokens each worker with a prefix saves: its hit, plus ``anchor_credit`` of the part of
        its full-attention depth that a group cannot serve (running there anchors that depth)."""
        credit: dict[WorkerId, float] = dict(hits)
        if shared:
            c = self.config.anchor_credit
            for worker, depth in shared.items():
                hit = hits.get(worker, 0)
                credit[worker] = hit + c * (depth - hit)
        return credit

    def _resolve_deferred(
        self,
        deferred: list[WorkerId],
        pending: Pending | None,
        hits: dict[WorkerId, int],
        shared: dict[WorkerId, int] | None,
        weights: dict[WorkerId, float],
        best_cost: float,
        best: list[WorkerId],
    ) -> tuple[float, list[WorkerId]]:
        """Resolve the pending workers whose optimistic cost could still win, then cost them
        (``weights``: each one's weight of an uncached token, see ``_pick``)."""
        assert pending is not None and shared is not None
        load_cost = self._load_cost
        slack = (1.0 - self.config.anchor_credit) * self.rules.alignment
        # the best a pending worker can have: a hit one aligned step below its depth
        contenders = [w for w in deferred if load_cost[w] - weights[w] * (shared[w] - slack) <= best_cost + 1e-9]
        if not contenders:
            return best_cost, best
        mask = 0
        for worker in contenders:
            mask |= self.index.bit(worker)
        self.index.resolve(pending, hits, mask)
        c = self.config.anchor_credit
        for worker in contenders:
            hit = hits.get(worker, 0)
            cost = load_cost[worker] - weights[worker] * (hit + c * (shared[worker] - hit))
            best_cost, best = _better(worker, cost, best_cost, best)
        return best_cost, best


def _better(worker: WorkerId, cost: float, best_cost: float, best: list[WorkerId]) -> tuple[float, list[WorkerId]]:
    """Fold one (worker, cost) into the running argmin (ties kept for the random pick)."""
    if cost < best_cost - 1e-9:
        return cost, [worker]
    if cost <= best_cost + 1e-9:
        best.append(worker)
    return best_cost, best
