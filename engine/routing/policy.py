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
remote-prefill rule (Mamba groups do not veto: seed 004).

Cost of ``route``: one index walk O(prefix blocks), a cost per worker with a prefix, and C-level
min/filter passes over the workers' load costs (the time averages are O(1), see ``load``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from configs.schema import RouterConfig
from engine.kv_cache.events import AllBlocksCleared, BlockStored, KVEvent
from engine.kv_cache.spec import KVCacheGroup
from engine.routing.index import PrefixIndex, WorkerSnapshot
from engine.routing.inflight import InFlightPrefixes
from engine.routing.load import DecayedWork, SmoothedQueues
from engine.routing.pins import HotPrefixes, Pin, PinTable
from engine.routing.policy_choice import CostChoice
from engine.routing.policy_pins import PinMaintenance
from engine.routing.router import Router
from engine.routing.types import (
    Action,
    Decision,
    RequestSnapshot,
    RouteRequest,
    WorkerId,
    WorkerLoad,
)


class RoutingPolicy(PinMaintenance, CostChoice, Router):
    """kvfleet's policy. See the module docstring for the cost and the rules; pin upkeep is
    ``PinMaintenance``'s (engine/routing/policy_pins.py), the argmin with its guards
    ``CostChoice``'s (engine/routing/policy_choice.py).

    Owns the prefix index, the pin table, the load and work averages and the in-flight prefixes;
    invariant: ``_load_cost``, ``_queued`` and the index track exactly the workers in ``roles``."""

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
        self._inflight = InFlightPrefixes(cfg.inflight_ttl_s)
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

    def _ahead(self, view: list[bytes], num_tokens: int, shared: dict[WorkerId, int], now: float) -> dict[WorkerId, int]:
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
