"""kvfleet's routing policy: exact hybrid-aware prefix prediction + load cost + cluster pins.

``RoutingPolicy`` is a pure object. Its caller (the router actor, or the simulator) feeds it
worker membership, load stats and KV events, asks it where each request runs (``route``), and
executes the actions it returns (``PinOn`` / ``Unpin`` / ``RequestSnapshot``, see ``types``).
Time is always passed in (``now``, seconds); the policy never reads a clock.

Placement of one request with N tokens (aggregated workers, role "both")::

    hit[w]    = index.predict(hashes, N - 1)[w]        exact: the worker coordinator's hit rules
    shared[w] = full-attention depth on w               the coordinator's shared_prefix_tokens
    credit[w] = hit[w] + anchor_credit * (shared[w] - hit[w])
    cost[w]   = (w_uncached + w_churn) * (N - credit[w]) + w_queued * queued_tokens[w]
              + w_running * running_requests[w] + w_used * used_block_fraction[w]
    guard     : skip w when queued_tokens[w] > imbalance_ratio * mean(queued_tokens) + N
                + imbalance_slack_tokens. A holder of the prefix is *over its share* when its queue
                averaged over time (half-life load_halflife_s) exceeds sustained_imbalance_ratio *
                the mean average + N, or when the work assigned to it lately (uncached tokens +
                request_work_tokens per request, decaying with half-life work_halflife_s) exceeds
                work_imbalance_ratio * the mean + this request's work (means over the pool the
                request is placed in: the prefill-capable workers, or the decode workers). Such a
                holder keeps its credit at w_uncached only (no churn term): the prefix spreads to
                another worker only where the holder's load costs more than recomputing it there
    pin       : if the request starts with a pinned prefix of length L, choose among the unguarded
                workers not over their share with hit[w] >= L (its holders, or any worker that has
                it) when there is one
    in flight : a worker the prompt's prefix was routed to and that has not reported those blocks
                yet (it is still computing or pulling them) is credited with them (``inflight``):
                a second request for a new prefix follows the first instead of computing it again
                elsewhere. This steers placement only; the predicted hit stays the index's.
    choice    = argmin cost; among equally loaded workers without the prefix, the one assigned the
                least work lately (it holds the fewest prefixes), then at random (seeded)

Why these terms: in a worker that serves requests in order, a queued token delays this request as
much as one of its own uncached tokens, and an uncached token also adds work every later request
waits for; so an uncached token costs about twice a queued one (the default weights 1.0 and 0.5).
On top, ``w_churn`` (1.0): an uncached token writes blocks (one per group) into the worker's
cache, evicting other prefixes there; in the simulator most lost hits are prefixes evicted by
that churn, so a miss is charged for it. The guards keep the stickier choice balanced.

Why the work guard (and the slack on the instantaneous one): at moderate load queues are short
and bursty, so a queue-length guard trips on a burst and sends a prefix's request to a worker
without it, which then caches a second copy; each copy takes room the least requested prefixes
need (in the simulator most lost hits are prefixes evicted from every worker, and mid-popular
prefixes copied on two workers were the difference to a sticky history-based router). Work
assigned over the last seconds is what busy time follows, so the guard balances busy time while a
prefix moves only when its holder keeps taking more than its share, and even then only when
waiting there costs more than computing the prefix again elsewhere: an idle holder keeps it. (A
guard that left the holder out whatever its queue sent warmed prefixes to cold prefill workers
at 1 request/s in serve_bench, where the holder had nothing queued: a second of TTFT each.)
The *anchor credit*: where the full-attention prefix is cached but a window (or a Mamba state) at
its end is not, the hit is lower (no false hit), yet running the request there makes the
coordinator retain the windows at that shared-prefix boundary when the request is freed, so the
next requests with this prefix hit there; half of the missing part is credited for that.

With dedicated prefill workers (P/D): the decode worker D minimises load cost plus a tenth of the
uncached cost (what it must pull); when D's own uncached part (full hit rules, it would prefill
locally) is below ``decode_only_threshold_tokens`` it prefills too, otherwise the prefill worker
is chosen as above among prefill-capable workers. The decode worker's transfer hit uses the
remote-prefill rule: Mamba groups do not veto the attention groups' hit, as their state arrives
with the transfer (docs/architecture.md, "The hybrid KV cache").

Cost of ``route``: one index walk O(prefix blocks), a cost per worker with a prefix, and C-level
min/filter passes over the workers' load costs (the time averages are O(1), see ``load``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from benchmarks.support.mask_router.index import Pending, PrefixIndex, WorkerSnapshot
from configs.schema import PinConfig, RouterConfig
from engine.kv_cache.events import AllBlocksCleared, BlockStored, KVEvent
from engine.kv_cache.hashing import block_hashes as hash_tokens
from engine.kv_cache.spec import KVCacheGroup
from engine.routing.hot_prefixes import HotPrefixes
from engine.routing.inflight import PyInFlightPrefixes
from engine.routing.load import DecayedWork, SmoothedQueues
from engine.routing.pins import Pin, PinTable
from engine.routing.placement_policy import PlacementPolicy
from engine.routing.types import (
    Action,
    Decision,
    PinInfo,
    RequestSnapshot,
    Role,
    RouteRequest,
    WorkerId,
    WorkerLoad,
)


class RoutingPolicy(PlacementPolicy):
    """kvfleet's policy. See the module docstring for the cost and the rules; below ``route`` come
    the argmin with its guards (``_pick``) and pin upkeep (placing, re-placing, revising pins).

    Owns the prefix index, the pin table, the load and work averages and the in-flight prefixes;
    invariants: ``_load_cost``, ``_queued`` and the index track exactly the workers in ``roles``; a
    key is in ``_auto_pins`` / ``_auto_decode_pins`` exactly while its automatic pin exists in
    ``pins``; choosing a worker changes nothing but the ``pending`` hits it resolves and the seeded
    random state."""

    name = "kvfleet"

    def __init__(self, groups: Sequence[KVCacheGroup], config: RouterConfig | None = None):
        """``config``: every weight, threshold and pin option (validated by ``RouterConfig``);
        the policy reads it directly. Configured pins are placed by ``engine.routing.factory``."""
        super().__init__(config.seed if config is not None else 0)
        self.config = config if config is not None else RouterConfig()
        self.weights = self.config.weights
        self.index = PrefixIndex(groups)
        self.rules = self.index.rules
        self.has_mamba = bool(self.rules.mamba_groups)
        cfg = self.config
        self._smoothed = SmoothedQueues(cfg.load_halflife_s) if cfg.load_halflife_s > 0 else None
        self._work = DecayedWork(cfg.work_halflife_s)
        self._now = 0.0
        self.pins = PinTable(self.index, cfg.pin_capacity_blocks)
        auto = cfg.auto_pin
        self.hot = HotPrefixes(self.rules.hash_block_size, self.rules.alignment) if auto.enabled else None
        self._auto_pins: dict[bytes, int] = {}  # hot prefix key -> pin id (prefill-capable workers)
        self._auto_decode_pins: dict[bytes, int] = {}  # the same on decode workers (P/D, on_decode_workers)
        self._last_auto: float | None = None
        self._load_cost: dict[WorkerId, float] = {}
        self._queued: dict[WorkerId, float] = {}
        self._queued_sum = 0.0
        self._disaggregated = False
        self._pending_snapshots: set[WorkerId] = set()
        # Prefixes routed but not yet reported, in the hash space of the first checked group.
        self._inflight = PyInFlightPrefixes(cfg.inflight_ttl_s)
        self._inflight_group = self.rules.order[0]
        self._inflight_block = self.rules.block_sizes[self._inflight_group]

    # -- membership and loads -------------------------------------------------------------------------
    def _added(self, worker: WorkerId, snapshot: WorkerSnapshot | None, now: float) -> list[Action]:
        """Track a worker (from ``snapshot`` if it already has a cache) and place pins short of
        replicas on it if it is their best holder."""
        self.index.add_worker(worker, snapshot)
        self._load_cost[worker] = 0.0
        self._queued[worker] = 0.0
        if self._smoothed is not None:
            self._smoothed.add(worker)
        self._work.add_worker(worker)
        self._disaggregated = any(r == "prefill" for r in self.roles.values())
        return self._fill_pins(now)

    def _removed(self, worker: WorkerId, load: WorkerLoad, now: float) -> list[Action]:
        """Forget a worker that left (or died): its cache, its load, its pins; re-place those pins."""
        self._queued_sum -= load.queued_tokens
        self.index.remove_worker(worker)
        self._load_cost.pop(worker, None)
        self._queued.pop(worker, None)
        if self._smoothed is not None:
            self._smoothed.remove(worker)
        self._work.remove(worker)
        self._disaggregated = any(r == "prefill" for r in self.roles.values())
        self._pending_snapshots.discard(worker)
        self._inflight.forget_worker(worker)
        self.pins.on_worker_removed(worker, now)
        return self._fill_pins(now)

    def update_load(self, worker: WorkerId, load: WorkerLoad) -> None:
        old = self.loads.get(worker)
        if old is None:
            return
        load = replace(load)  # the router adds its own assignments to its copy
        self._queued_sum += load.queued_tokens - old.queued_tokens
        self.loads[worker] = load
        self._queued[worker] = load.queued_tokens
        if self._smoothed is not None:
            self._smoothed.set(worker, load.queued_tokens)
        self._load_cost[worker] = self._cost_of(load)

    @property
    def w_miss(self) -> float:
        """Weight of an uncached prefill token: its compute plus the cache churn it causes."""
        return self.weights.uncached_tokens + self.weights.cache_churn

    def _cost_of(self, load: WorkerLoad) -> float:
        return (
            self.weights.queued_tokens * load.queued_tokens
            + self.weights.running_requests * load.running_requests
            + self.weights.used_block_fraction * load.used_block_fraction
        )

    # -- events ---------------------------------------------------------------------------------------
    def apply_events(self, worker: WorkerId, events: Iterable[KVEvent], now: float = 0.0) -> list[Action]:
        """Apply a worker's KV events; returns a snapshot request on a sequence gap and pin
        re-establishment actions when a holder's pinned blocks were demoted or evicted."""
        if worker not in self.roles:
            return []
        events = events if isinstance(events, list) else list(events)
        if self._inflight:
            self._forget_reported(worker, events)
        outcome = self.index.apply_events(worker, events, self.pins.watch.get(worker))
        return self._after_update(worker, outcome.needs_resync, outcome.lost, outcome.cleared, now)

    def _forget_reported(self, worker: WorkerId, events: list[KVEvent]) -> None:
        """Blocks a worker reports are the index's business from now on (so an in-flight entry
        never outlives the blocks it announced); a cleared cache drops them all."""
        group = self._inflight_group
        for event in events:
            if isinstance(event, BlockStored) and event.group == group:
                self._inflight.discard(worker, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._inflight.forget_worker(worker)

    def apply_snapshot(self, worker: WorkerId, snapshot: WorkerSnapshot, now: float = 0.0) -> list[Action]:
        if worker not in self.roles:
            return []
        self._pending_snapshots.discard(worker)
        self._inflight.forget_worker(worker)
        outcome = self.index.apply_snapshot(worker, snapshot)
        # Re-check every active holder on this worker against the snapshot.
        watch = self.pins.watch.get(worker, {})
        lost = [key for key in watch if self.index.pin_level(worker, key[0], key[1]) != 2]
        lost.extend(outcome.lost or ())
        return self._after_update(worker, outcome.needs_resync, lost, outcome.cleared, now)

    def _after_update(
        self, worker: WorkerId, resync: bool, lost: list[tuple[int, bytes]] | None, cleared: bool, now: float
    ) -> list[Action]:
        actions: list[Action] = []
        if resync and worker not in self._pending_snapshots:
            self._pending_snapshots.add(worker)
            actions.append(RequestSnapshot(worker))
        missing = self.pins.verify(worker, now) if self.pins.pins else []
        if cleared:
            actions.extend(self.pins.on_cleared(worker, now))
        if lost or missing:
            actions.extend(self.pins.on_lost(worker, (lost or []) + missing, now))
        if cleared or lost or missing:
            actions.extend(self._fill_pins(now))
        return actions

    # -- placement ------------------------------------------------------------------------------------
    def route(self, request: RouteRequest, now: float = 0.0) -> Decision:
        """Choose (prefill, decode) workers for ``request``; see the module docstring."""
        hashes = request.block_hashes
        num_tokens = request.num_tokens
        self._now = now
        if self._smoothed is not None:
            self._smoothed.now = max(self._smoothed.now, now)
        shared: dict[WorkerId, int] = {}
        hits, pending = self.index.predict_partial(hashes, num_tokens - 1, shared=shared)
        pin = self.pins.match(hashes) if self.pins.by_key else None
        if pin is not None and pin.auto:
            pin = None  # automatic pins keep a prefix resident; placement stays the cost's
        view = self.rules.managers[self._inflight_group].view(hashes if isinstance(hashes, list) else list(hashes))
        ahead = self._ahead(view, num_tokens, shared, now) if self._inflight else {}
        if pending is not None and (pin is not None or self._disaggregated or ahead):
            self.index.resolve(pending, hits)
            pending = None
        if self.hot is not None:
            self.hot.observe(hashes, now)
        if not self._disaggregated:
            workers = list(self._load_cost)
            self._require(workers, "")
            worker, reason = self._pick(workers, hits, num_tokens, pin, self.w_miss, shared, pending, ahead)
            pin_id = pin.pin_id if pin is not None else None
            best = max(hits.values(), default=0)  # pending workers: a lower bound (never a false "below")
            decision = Decision(worker, worker, hits.get(worker, 0), num_tokens, reason, pin_id, best_hit=best)
        else:
            decision = self._route_disaggregated(request, hits, pin, shared, ahead)
        self._record(decision)
        # Both workers will hold the prompt's first N - 1 tokens (computed, or pulled by D); the
        # part each already holds is the index's business.
        block = self._inflight_block
        end = (num_tokens - 1) // block
        if self._inflight.ttl_s > 0:
            kept = tuple(view)  # the request's list is the caller's
            for worker in {decision.prefill_worker, decision.decode_worker}:
                self._inflight.add(worker, kept, shared.get(worker, 0) // block, end, now)
        return decision

    def _ahead(
        self, view: list[bytes], num_tokens: int, shared: dict[WorkerId, int], now: float
    ) -> dict[WorkerId, int]:
        """Tokens of this prompt each worker will hold once the requests routed to it have run
        (what it holds, extended by what it was sent and has not reported), aligned like a hit
        and below N; only workers with such unreported blocks."""
        block = self._inflight_block
        known = {w: depth // block for w, depth in shared.items()} if shared else None
        depths = self._inflight.depths(view, now, known)
        if not depths:
            return {}
        cap = self.rules.aligned(num_tokens - 1)
        return {w: min(cap, self.rules.aligned(d * block)) for w, d in depths.items()}

    def _route_disaggregated(
        self,
        request: RouteRequest,
        hits: dict[WorkerId, int],
        pin: Pin | None,
        shared: dict[WorkerId, int],
        ahead: dict[WorkerId, int],
    ) -> Decision:
        num_tokens = request.num_tokens
        decoders = self._candidates("decode")
        self._require(decoders, "decode")
        remote_hits = hits
        if self.has_mamba:  # the decode side of a remote prefill: Mamba groups do not veto
            remote_hits = self.index.predict(request.block_hashes, num_tokens - 1, skip_mamba=True)
        decode, _ = self._pick(decoders, remote_hits, num_tokens, None, 0.1 * self.weights.uncached_tokens, ahead=ahead)
        local_uncached = num_tokens - hits.get(decode, 0)
        pin_id = pin.pin_id if pin is not None else None
        if local_uncached < self.config.decode_only_threshold_tokens:
            local = hits.get(decode, 0)
            return Decision(decode, decode, local, num_tokens, "decode_only", pin_id, local, local)
        prefillers = self._candidates("prefill")
        prefill, reason = self._pick(prefillers, hits, num_tokens, pin, self.w_miss, shared, ahead=ahead)
        predicted = hits.get(prefill, 0)
        if predicted > num_tokens - 2:
            # A prefill-only request computes the first N - 1 tokens, so its engine looks up at
            # most N - 2 of them: predict exactly what that lookup returns.
            predicted = self.index.hit(prefill, request.block_hashes, num_tokens - 2)
        best = max((hits.get(w, 0) for w in prefillers), default=0)
        best = predicted if hits.get(prefill, 0) >= best else best  # the same N - 2 rule as predicted
        return Decision(
            prefill,
            decode,
            predicted,
            num_tokens,
            reason,
            pin_id,
            remote_hits.get(decode, 0),
            best,
        )

    def _record(self, decision: Decision) -> None:
        before = self.loads[decision.prefill_worker].queued_tokens
        self._work.add(decision.prefill_worker, decision.uncached_tokens + self.config.request_work_tokens, self._now)
        super()._record(decision)
        self._queued_sum += self.loads[decision.prefill_worker].queued_tokens - before
        for worker in {decision.prefill_worker, decision.decode_worker}:
            self._load_cost[worker] = self._cost_of(self.loads[worker])
            self._queued[worker] = self.loads[worker].queued_tokens
            if self._smoothed is not None:
                self._smoothed.set(worker, self._queued[worker])

    # -- choosing one worker by cost ------------------------------------------------------------------
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

    # -- pins: placing, re-placing and revising ---------------------------------------------------------
    def pin_configured(
        self, pins: Sequence[PinConfig], tokenize: Callable[[str], list[int]] | None, now: float
    ) -> None:
        """Pin the prefixes of ``router.pins`` (text needs ``tokenize``)."""
        for i, pin in enumerate(pins):
            if pin.token_ids is not None:
                tokens = list(pin.token_ids)
            elif tokenize is None:
                raise ValueError(f"router.pins.{i}.text: pinning text needs a tokenizer (pass tokenize=...)")
            else:
                tokens = tokenize(pin.text or "")
            self.pin(tokens, replicas=pin.replicas, ttl_s=pin.ttl_s, now=now)

    def pin(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[bytes] | None = None,
        num_tokens: int | None = None,
        replicas: int = 1,
        ttl_s: float | None = None,
        now: float = 0.0,
        pin_id: int | None = None,
    ) -> tuple[int, list[Action]]:
        """Pin a prefix cluster-wide on ``replicas`` workers, optionally for ``ttl_s`` seconds
        (under ``pin_id`` when restoring a pin a restarted router had).

        Give ``token_ids`` (then new holders can compute it) or ``block_hashes`` (+ ``num_tokens``;
        holders must already have it or copy it from another holder). Returns the pin id and the
        actions placing it. Raises ``PinCapacityError`` beyond ``pin_capacity_blocks``.
        """
        if token_ids is not None:
            hashes = hash_tokens(token_ids, self.rules.hash_block_size)
            length = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        elif block_hashes is not None:
            hashes = list(block_hashes)
            length = num_tokens if num_tokens is not None else len(hashes) * self.rules.hash_block_size
        else:
            raise ValueError("pin: give token_ids or block_hashes")
        if self.roles and replicas > len(self._candidates("prefill")):
            raise ValueError(
                f"replicas: replicas={replicas} but only {len(self._candidates('prefill'))} workers can hold pins"
            )
        pin = self.pins.create(hashes, length, replicas, now, ttl_s, token_ids, pin_id=pin_id)
        return pin.pin_id, self.pins.fill(pin, now, self._choose_holder)

    def unpin(self, pin_id: int, now: float = 0.0) -> list[Action]:
        """Remove a pin everywhere (its capacity is released)."""
        for pinned in (self._auto_pins, self._auto_decode_pins):
            key = next((k for k, p in pinned.items() if p == pin_id), None)
            if key is not None:
                del pinned[key]
        return self.pins.remove(pin_id)

    def pin_result(
        self, worker: WorkerId, pin_id: int, pinned_tokens: int, now: float = 0.0, seq: int | None = None
    ) -> list[Action]:
        """A ``PinOn`` finished on ``worker``: ``pin_prefix`` returned ``pinned_tokens``; ``seq`` is
        the worker's last KV event number at that moment (lets the router verify the pin)."""
        actions = self.pins.on_result(worker, pin_id, pinned_tokens, now, seq)
        pin = self.pins.pins.get(pin_id)
        if pin is not None and pinned_tokens < pin.length:
            actions.extend(self.pins.fill(pin, now, self._choose_holder))
        if worker in self.roles:
            missing = self.pins.verify(worker, now)
            if missing:
                actions.extend(self.pins.on_lost(worker, missing, now))
                actions.extend(self._fill_pins(now))
        return actions

    def pin_info(self) -> list[PinInfo]:
        return [pin.info({w: pin.tier for w in pin.active()}) for pin in self.pins.pins.values()]  # no host tiers here

    def _fill_pins(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for pin in list(self.pins.pins.values()):
            if len(pin.holders) < pin.replicas:
                actions.extend(self.pins.fill(pin, now, self._choose_holder))
        return actions

    def _choose_holder(self, pin: Pin, exclude: set[WorkerId]) -> WorkerId | None:
        """Best new holder: a worker that already caches the prefix, then the one with the fewest
        pinned blocks, then the least loaded; never beyond ``pin_worker_fraction`` of its pool
        (for an explicit pin, counting explicit pins only: automatic ones give way, and the
        worker's pinned tier demotes the oldest under pressure)."""
        hits = self.index.predict(pin.block_hashes, pin.length)
        can_build = pin.token_ids is not None or bool(pin.active())
        best: tuple[int, int, float, float] | None = None
        choice: WorkerId | None = None
        for worker in self._candidates(pin.role):
            if worker in exclude:
                continue
            resident = hits.get(worker, 0) >= pin.length
            if not resident and not can_build:
                continue
            pinned = self.pins.worker_blocks.get(worker, 0)
            if not pin.auto:  # the user's pins come first: automatic ones are best effort
                pinned -= self.pins.auto_worker_blocks.get(worker, 0)
            limit = self.num_blocks.get(worker)
            if limit is not None and pinned + pin.blocks_per_replica > self.config.pin_worker_fraction * limit:
                continue
            key = (0 if resident else 1, pinned, self._load_cost.get(worker, 0.0), self.rng.random())
            if best is None or key < best:
                best, choice = key, worker
        return choice

    def tick(self, now: float) -> list[Action]:
        """Time-driven work: pin TTLs, PENDING timeouts, retries, automatic pinning."""
        actions = self.pins.expire(now)
        due = self._last_auto is None or now - self._last_auto >= self.config.auto_pin.interval_s
        if self.hot is not None and due:
            self._last_auto = now
            actions.extend(self._auto_pin(now))
        actions.extend(self._fill_pins(now))
        return actions

    def _auto_pin(self, now: float) -> list[Action]:
        """Pin the hottest shared prefixes (>= ``auto_pin_min_requests`` recent requests) within
        the budget (``auto_pin_budget_blocks``, else ``auto_pin_budget_fraction`` of the
        prefill-capable workers' pools); unpin automatic pins that fell out of that set. With
        dedicated decode workers and ``auto_pin.on_decode_workers``, the same on the decode
        workers' caches (their own budget: that fraction of their pools)."""
        hot = self.hot
        assert hot is not None
        hot.decay(now)
        cfg = self.config.auto_pin
        actions = self._revise_auto(self._auto_pins, "prefill", now)
        if self._disaggregated and cfg.on_decode_workers:
            actions.extend(self._revise_auto(self._auto_decode_pins, "decode", now))
        elif self._auto_decode_pins:
            for key in list(self._auto_decode_pins):
                actions.extend(self.pins.remove(self._auto_decode_pins.pop(key)))
        return actions

    def _revise_auto(self, pinned: dict[bytes, int], role: Role, now: float) -> list[Action]:
        """One revision of the automatic pins held by ``role``'s workers (``pinned``: key -> id)."""
        hot = self.hot
        assert hot is not None
        cfg = self.config.auto_pin
        holders = self._candidates(role)
        budget = cfg.budget_blocks or int(cfg.budget_fraction * sum(self.num_blocks.get(w) or 0 for w in holders))

        def rank(key: bytes) -> float:
            count = hot.counts[key].count
            return count * 1.5 if key in pinned else count  # hysteresis for current pins

        chosen: list[bytes] = []
        used = 0
        replicas = min(cfg.replicas, max(1, len(holders)))
        for key in sorted(hot.counts, key=rank, reverse=True):
            prefix = hot.counts[key]
            if prefix.count < cfg.min_requests and key not in pinned:
                break
            cost = self.pins.cost_blocks(prefix.block_hashes, prefix.length) * replicas
            if used + cost <= budget:
                chosen.append(key)
                used += cost
        actions: list[Action] = []
        keep = set(chosen)
        for key in [k for k in pinned if k not in keep]:
            actions.extend(self.pins.remove(pinned.pop(key)))
        for key in chosen:
            if key in pinned:
                continue
            prefix = hot.counts[key]
            pin = self.pins.create(prefix.block_hashes, prefix.length, replicas, now, auto=True, role=role)
            pinned[key] = pin.pin_id
            actions.extend(self.pins.fill(pin, now, self._choose_holder))
        return actions


def _better(worker: WorkerId, cost: float, best_cost: float, best: list[WorkerId]) -> tuple[float, list[WorkerId]]:
    """Fold one (worker, cost) into the running argmin (ties kept for the random pick)."""
    if cost < best_cost - 1e-9:
        return cost, [worker]
    if cost <= best_cost + 1e-9:
        best.append(worker)
    return best_cost, best
