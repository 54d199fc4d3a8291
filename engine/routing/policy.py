"""kvfleet's routing policy: exact hybrid-aware prefix prediction + load cost + cluster pins.

``RoutingPolicy`` is a pure object. Its caller (the router actor, or the simulator) feeds it
worker membership, load stats and KV events, asks it where each request runs (``route``), and
executes the actions it returns (``PinOn`` / ``Unpin`` / ``RequestSnapshot``, see ``types``).
Time is always passed in (``now``, seconds); the policy never reads a clock.

Placement of one request with N tokens (aggregated workers, role "both")::

    hit[w]    = index.predict(hashes, N - 1)[w]        exact: the worker coordinator's hit rules
                                                        (over both tiers with a host tier)
    host[w]   = the part of hit[w] w's host tier serves
    shared[w] = full-attention depth on w               the coordinator's shared_prefix_tokens
    credit[w] = hit[w] - host[w] * load[w] + anchor_credit * (shared[w] - hit[w])
    load[w]   = min(1, promote_seconds * promote_s_per_token[w] / (w_uncached + w_churn))
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
    family    : where the deepest prefix a worker holds of the prompt was reused by fewer than
                family_min_reuse requests lately (``prefix_reuse.PrefixReuse``, half-life
                work_halflife_s), the request is a family of its own (a conversation's next turn):
                its hit is worth w_uncached + w_churn + family_hit_weight a token (a move leaves a
                copy nobody reuses on the holder), the holder keeps that weight when over its
                share and the instantaneous guard does not apply: that guard stops a stream of one
                prefix's requests piling onto its holder, and such a family brings one at a time
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
A host-tier hit token is not recomputed but copied back to the device: it costs the time of
that copy (the worker's measured seconds per token, weighted by ``promote_seconds``, in prefill
tokens per second) instead of a miss's prefill (``LoadBook.credit`` with ``promote_load``, the
one place of that rule, in both books).

The *anchor credit*: where the full-attention prefix is cached but a window (or a Mamba state) at
its end is not, the hit is lower (no false hit), yet running the request there makes the
coordinator retain the windows at that shared-prefix boundary when the request is freed, so the
next requests with this prefix hit there; half of the missing part is credited for that.

With dedicated prefill workers (P/D): the decode worker D minimises load cost plus a tenth of the
uncached cost (what it must pull); when D's own uncached part (full hit rules, it would prefill
locally) is below ``decode_only_threshold_tokens`` it prefills too, otherwise the prefill worker
is chosen as above among prefill-capable workers. Then the request still runs whole on a decode
worker where that costs less (load cost plus uncached part at the miss weight) than the remote
path (the prefill worker's load cost plus its uncached part plus the pull): on any decode
worker holding all but ``decode_only_threshold_tokens`` of the prompt (``decode_only``: D was
chosen for its load, another decode worker may hold the prefix), and on D itself while the
prefill worker is congested, its load cost above ``local_prefill_margin_tokens`` uncached
tokens' (``decode_local``): first requests of new prefixes arriving together spread over every
worker instead of queueing two to a prefill worker, while an idle prefill pool keeps every long
prefill. The decode worker's transfer hit uses the
remote-prefill rule: Mamba groups do not veto the attention groups' hit, as their state arrives
with the transfer (docs/architecture.md, "The hybrid KV cache"). A one-token request
(``RouteRequest.max_tokens`` 1, no pin) has nothing to decode: it runs whole (``one_token``) on
the cheapest worker of either role, placed as an aggregated request is, so an idle prefill
worker serves it too (``decode_only_threshold_tokens`` 0 splits every request, one-token ones too).

Cost of ``route`` (aggregated workers): one index walk O(prefix blocks + holders met), a cost per
worker with a prefix, and the least loaded other worker from the load order (``LoadOrder``, a heap
by load cost then work assigned lately, O(log W) per change and per pick; the time averages are
O(1), see ``load``): nothing loops over every worker. A pass over the workers remains for a
sub-pool (dedicated prefill or decode workers) and when the least loaded are all guarded.
The per-worker load state (time averages, work, load order) and the pick's argmin live in a
``load.LoadBook``; where the compiled book is built, the common aggregated decision (no pin,
nothing pending, host-tier hits or not, a family of its own or not) is chosen, recorded and made a
``Decision`` by one call
into it (``LoadBook.place``), and ``_pick`` / ``_record`` below are the reference that call is
tested against (tests/routing/test_core_parity.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from configs.schema import PinConfig, RouterConfig
from engine.kv_cache.coordinator_types import PinTier
from engine.kv_cache.events import KVEvent
from engine.kv_cache.spec import KVCacheGroup
from engine.routing.index import Pending, PrefixIndex, WorkerSnapshot
from engine.routing.load import (
    LEAST_LOADED_PROBES,
    LoadBook,
    better,
    knobs_of,
    make_load_book,
    miss_weight,
    reason_of,
)
from engine.routing.pin_upkeep import PinKeeper
from engine.routing.pins import Pin
from engine.routing.placement_policy import PlacementPolicy
from engine.routing.prefix_reuse import ReuseCounts, make_prefix_reuse
from engine.routing.routed import RoutedPrefixes
from engine.routing.types import (
    Action,
    Decision,
    PinInfo,
    RequestSnapshot,
    RouteRequest,
    WorkerId,
    WorkerLoad,
)


class RoutingPolicy(PlacementPolicy):
    """kvfleet's policy. See the module docstring for the cost and the rules; below ``route`` come
    the argmin with its guards (``_pick``) and pin upkeep (placing, re-placing, revising pins).

    Owns the prefix index, the pin upkeep (``pin_upkeep.PinKeeper``: the pin table ``pins``, the
    hot prefixes, automatic pins), the load and work averages and the in-flight prefixes;
    invariants: the load book (``load.LoadBook``: queued tokens, load costs, their averages) and
    the index track exactly the workers in ``roles``;
    choosing a worker changes nothing but the ``pending`` hits it resolves and the seeded random
    state."""

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
        # queued tokens and load costs, their time averages, work assigned lately, the load order
        self.book: LoadBook = make_load_book(knobs_of(cfg), self.loads, self.rng.randrange)
        self._now = 0.0
        # the pin table, hot prefixes and automatic pins, with the rules placing them
        keeper = PinKeeper(
            self.index, cfg, self.rng, self.roles, self.num_blocks, self.book.load_cost, self._candidates
        )
        self.pin_keeper = keeper
        self.pins = keeper.pins
        self.hot = keeper.hot
        self._pool: list[WorkerId] = []  # every worker, in order of arrival (the aggregated pool)
        self._disaggregated = False
        self._pending_snapshots: set[WorkerId] = set()
        # Prefixes routed but not yet reported, in the hash space of the first checked group.
        self.routed = RoutedPrefixes(self.rules, cfg.inflight_ttl_s)
        # the whole-pool shortcut's weights, read once per decision (``w_miss``; ``_pick``'s w_spread)
        self._shortcut_weights = (self.w_miss, min(self.w_miss, self.weights.uncached_tokens))
        # how often each cached prefix was reused lately (a family of its own or a popular prefix)
        self.reuse: ReuseCounts = make_prefix_reuse(cfg.work_halflife_s)

    # -- membership and loads -------------------------------------------------------------------------
    def _added(self, worker: WorkerId, snapshot: WorkerSnapshot | None, now: float) -> list[Action]:
        """Track a worker (from ``snapshot`` if it already has a cache) and place pins short of
        replicas on it if it is their best holder."""
        self.index.add_worker(worker, snapshot)
        self.book.add(worker)
        self._pool = list(self.book.load_cost)
        self._disaggregated = any(r == "prefill" for r in self.roles.values())
        return self.pin_keeper.fill(now)

    def _removed(self, worker: WorkerId, load: WorkerLoad, now: float) -> list[Action]:
        """Forget a worker that left (or died): its cache, its load, its pins; re-place those pins."""
        self.index.remove_worker(worker)
        self.book.remove(worker)
        self._pool = list(self.book.load_cost)
        self._disaggregated = any(r == "prefill" for r in self.roles.values())
        self._pending_snapshots.discard(worker)
        self.routed.forget_worker(worker)
        self.pins.on_worker_removed(worker, now)
        return self.pin_keeper.fill(now)

    def update_load(self, worker: WorkerId, load: WorkerLoad) -> None:
        old = self.loads.get(worker)
        if old is None:
            return
        load = replace(load)  # the router adds its own assignments to its copy
        self.loads[worker] = load
        self.book.report(worker, load)

    @property
    def w_pull(self) -> float:
        """Weight of a token a decode worker pulls from the prefill worker: a tenth of computing it."""
        return 0.1 * self.weights.uncached_tokens

    @property
    def w_miss(self) -> float:
        """Weight of an uncached prefill token: its compute plus the cache churn it causes
        (``load.miss_weight``)."""
        return miss_weight(self.weights)

    # -- events ---------------------------------------------------------------------------------------
    def apply_events(self, worker: WorkerId, events: Iterable[KVEvent], now: float = 0.0) -> list[Action]:
        """Apply a worker's KV events; returns a snapshot request on a sequence gap and pin
        re-establishment actions when a holder no longer holds a pin's blocks in either tier
        (``PinTable.key_tier``: a device-tier pin its device offloaded stays, in the host tier)."""
        if worker not in self.roles:
            return []
        events = events if isinstance(events, list) else list(events)
        if self.routed:
            self.routed.forget_reported(worker, events)
        outcome = self.index.apply_events(worker, events, self.pins.watch.get(worker))
        return self._after_update(worker, outcome.needs_resync, outcome.lost, outcome.cleared, now)

    def apply_snapshot(self, worker: WorkerId, snapshot: WorkerSnapshot, now: float = 0.0) -> list[Action]:
        if worker not in self.roles:
            return []
        self._pending_snapshots.discard(worker)
        self.routed.forget_worker(worker)
        outcome = self.index.apply_snapshot(worker, snapshot)
        # Re-check every active holder on this worker against the snapshot (``PinTable.on_lost``
        # keeps the keys still held in either tier).
        lost = list(self.pins.watch.get(worker, ()))
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
            actions.extend(self.pin_keeper.fill(now))
        return actions

    # -- placement ------------------------------------------------------------------------------------
    def route(self, request: RouteRequest, now: float = 0.0) -> Decision:
        """Choose (prefill, decode) workers for ``request``; see the module docstring."""
        hashes = request.block_hashes
        num_tokens = request.num_tokens
        self._now = now
        self.book.advance(now)
        shared: dict[WorkerId, int] = {}
        host: dict[WorkerId, int] = {}
        hits, pending, reach = self.index.predict_partial(hashes, num_tokens - 1, shared=shared, host=host)
        pin = self.pins.match(hashes) if self.pins.by_key else None
        if pin is not None and pin.auto:
            pin = None  # automatic pins keep a prefix resident; placement stays the cost's
        routed = self.routed
        view = routed.view(hashes)
        ahead = routed.ahead(view, num_tokens, shared, now)
        if pending is not None and (pin is not None or self._disaggregated or ahead):
            self.index.resolve(pending, hits)
            pending = None
        if self.hot is not None:
            self.hot.observe(hashes, now)
        if not self._disaggregated:
            workers = self._pool
            if not workers:
                self._require(workers, "")
            w_miss, w_spread, family = self._request_weights(hashes, hits, reach, now)
            decision = None
            if pin is None:  # the book's whole-pool pick and record, where it can
                pending_workers = pending.workers if pending is not None else ()
                decision = self.book.place(
                    hits, shared, host, ahead, pending_workers, num_tokens, now, w_miss, w_spread, not family
                )
            if decision is None:
                worker, reason = self._pick(
                    workers, hits, num_tokens, pin, w_miss, shared, pending, ahead, host, w_spread, not family
                )
                pin_id = pin.pin_id if pin is not None else None
                best = max(hits.values(), default=0)  # pending workers: a lower bound (never a false "below")
                decision = Decision(
                    worker,
                    worker,
                    hits.get(worker, 0),
                    num_tokens,
                    reason,
                    pin_id,
                    best_hit=best,
                    predicted_host_hit=host.get(worker, 0),
                )
                self._record(decision)
        else:
            decision = self._route_disaggregated(request, hits, pin, shared, ahead, host, reach)
            self._record(decision)
        routed.announce(decision, view, shared, num_tokens, now)
        return decision

    def _route_disaggregated(
        self,
        request: RouteRequest,
        hits: dict[WorkerId, int],
        pin: Pin | None,
        shared: dict[WorkerId, int],
        ahead: dict[WorkerId, int],
        host: dict[WorkerId, int],
        reach: int,
    ) -> Decision:
        num_tokens = request.num_tokens
        threshold = self.config.decode_only_threshold_tokens
        if request.max_tokens == 1 and pin is None and threshold > 0:
            # its token is sampled by its prefill: a split moves KV for nothing (module docstring)
            worker, _ = self._pick(self._pool, hits, num_tokens, None, self.w_miss, shared, ahead=ahead, host=host)
            return self._whole_decision(
                worker, hits, host, num_tokens, None, "one_token", max(hits.values(), default=0)
            )
        decoders = self._candidates("decode")
        self._require(decoders, "decode")
        remote_hits = hits
        if self.has_mamba:  # the decode side of a remote prefill: Mamba groups do not veto
            remote_hits = self.index.predict(request.block_hashes, num_tokens - 1, skip_mamba=True)
        decode, _ = self._pick(decoders, remote_hits, num_tokens, None, self.w_pull, ahead=ahead)
        local_uncached = num_tokens - hits.get(decode, 0)
        pin_id = pin.pin_id if pin is not None else None
        if local_uncached < threshold:
            return self._whole_decision(decode, hits, host, num_tokens, pin_id, "decode_only")
        prefillers = self._candidates("prefill")
        w_miss, w_spread, family = self._request_weights(request.block_hashes, hits, reach, self._now)
        prefill, reason = self._pick(
            prefillers,
            hits,
            num_tokens,
            pin,
            w_miss,
            shared,
            ahead=ahead,
            host=host,
            w_spread=w_spread,
            guard=not family,
        )
        whole = self._whole_on_decode(prefill, decode, hits, remote_hits, num_tokens) if pin is None else None
        if whole is not None:
            uncached = num_tokens - hits.get(whole, 0)
            return self._whole_decision(
                whole, hits, host, num_tokens, None, "decode_only" if uncached < threshold else "decode_local"
            )
        predicted = hits.get(prefill, 0)
        predicted_host = host.get(prefill, 0)
        if predicted > num_tokens - 2:
            # A prefill-only request computes the first N - 1 tokens, so its engine looks up at
            # most N - 2 of them: predict exactly what that lookup returns.
            found = self.index.tiered_hit(prefill, request.block_hashes, num_tokens - 2)
            predicted, predicted_host = found.tokens, found.host_tokens
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
            predicted_host,
        )

    def _whole_decision(
        self,
        worker: WorkerId,
        hits: dict[WorkerId, int],
        host: dict[WorkerId, int],
        n: int,
        pin_id: int | None,
        reason: str,
        best: int | None = None,
    ) -> Decision:
        """The request runs whole on ``worker`` (its prefill there, no transfer), labelled
        ``reason``: "one_token" (a one-token request, ``_route_disaggregated``), "decode_only" (a
        decode worker holding all but ``decode_only_threshold_tokens`` of the prompt) or
        "decode_local" (it prefills a long prompt itself, ``_whole_on_decode``). ``best``: the
        best hit of the pool it was chosen in (None: its own)."""
        local = hits.get(worker, 0)
        return Decision(
            worker, worker, local, n, reason, pin_id, local, local if best is None else best, host.get(worker, 0)
        )

    def _whole_on_decode(
        self, prefill: WorkerId, decode: WorkerId, hits: dict[WorkerId, int], pulled: dict[WorkerId, int], n: int
    ) -> WorkerId | None:
        """A decode worker that should run the request whole instead of the remote prefill on
        ``prefill`` (then decoding on ``decode``), or None: the cheapest of (a) a decode worker
        holding all but ``decode_only_threshold_tokens`` of the prompt (another decode worker than
        the one chosen for decoding may hold it: recomputing it on a prefill worker would waste
        that hit) and (b) ``decode`` itself while ``prefill`` is congested (its load costs more than
        ``local_prefill_margin_tokens`` uncached tokens), where its load cost plus its uncached part
        is below ``prefill``'s plus its uncached part plus the pull (the rule of the module
        docstring's P/D paragraph). ``pulled``: ``decode``'s hit under the remote-prefill rule."""
        w_miss = self.w_miss
        load_cost = self.book.load_cost
        queue = load_cost[prefill]
        best_cost = queue + w_miss * (n - hits.get(prefill, 0))
        best_cost += self.w_pull * (n - pulled.get(decode, 0))
        margin = self.config.local_prefill_margin_tokens
        congested = margin is not None and queue > w_miss * margin
        threshold = self.config.decode_only_threshold_tokens
        roles = self.roles
        best: WorkerId | None = None
        for worker in (decode, *hits):
            if roles.get(worker) != "decode":
                continue
            uncached = n - hits.get(worker, 0)
            if uncached >= threshold and not (congested and worker == decode):
                continue
            cost = load_cost[worker] + w_miss * uncached
            if cost < best_cost:
                best, best_cost = worker, cost
        return best

    def _record(self, decision: Decision) -> None:
        """Count the assignment in the book: a request running whole on one worker is the book's
        ``assign``; a remote prefill adds its work to the prefill worker and a running request to
        each side (``PlacementPolicy._record``), reported to the book."""
        prefill, decode = decision.prefill_worker, decision.decode_worker
        book = self.book
        if prefill == decode:
            book.assign(prefill, decision.uncached_tokens, self._now)
            return
        book.add_work(prefill, decision.uncached_tokens + self.config.request_work_tokens, self._now)
        super()._record(decision)
        book.report(prefill, self.loads[prefill])
        book.report(decode, self.loads[decode])

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
        host: dict[WorkerId, int] | None = None,
        w_spread: float | None = None,
        guard: bool = True,
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
        (credited where they exceed what the index knows; the caller resolves ``pending`` first).
        ``host``: the host tier's part of a worker's hit (``LoadBook.credit`` prices it).
        ``w_spread``: the weight a holder over its share keeps (None: the compute weight);
        ``guard`` False: no worker is left out for its queue (a family of its own,
        ``_request_weights``)."""
        book = self.book
        load_cost = book.load_cost
        whole = len(workers) == len(load_cost)
        among = load_cost if whole else set(workers)
        limit, slow, cap = self._guard(num_tokens, workers)
        if not guard:
            limit = math.inf
        queued = book.queued
        now = self._now
        credit = book.credit(hits, shared, host, ahead)
        reason = "cost"
        if pin is not None:
            resident = [
                w
                for w, h in hits.items()
                if h >= pin.length and w in among and queued[w] <= limit and not book.over(w, now, slow, cap)
            ]
            if resident:
                credit = {w: credit[w] for w in resident}
                reason = "pin"
        if w_spread is None:
            w_spread = min(w_uncached, self.weights.uncached_tokens)
        # the argmin over the workers with a prefix, then the load order's least loaded other
        # worker for the whole pool (``LoadBook.scan``); spread: holders over their share
        probes = len(credit) + LEAST_LOADED_PROBES if whole and reason != "pin" else -1
        pending_workers = pending.workers if pending is not None else ()
        best_cost, best, deferred, spread, guarded, fresh = book.scan(
            credit, among, limit, now, slow, cap, w_uncached, w_spread, pending_workers, probes
        )
        if reason != "pin" and not fresh:  # workers without any prefix: their load cost alone
            ok = lambda w: queued[w] <= limit  # noqa: E731
            best_cost, best, guarded = self._least_loaded_scan(workers, credit, ok, best_cost, best, guarded)
        if deferred:
            weights = {w: w_spread if w in spread else w_uncached for w in deferred}
            best_cost, best = self._resolve_deferred(deferred, pending, hits, shared, weights, best_cost, best)
        if not best:  # every candidate guarded (possible only for a subset of the workers)
            return min(workers, key=lambda w: load_cost[w] - w_uncached * hits.get(w, 0)), "guard"
        choice = best[0] if len(best) == 1 else best[self.rng.randrange(len(best))]
        return choice, reason if reason == "pin" else reason_of(choice, hits, ahead, guarded, spread)

    def _request_weights(
        self, hashes: Sequence[bytes], hits: dict[WorkerId, int], reach: int, now: float
    ) -> tuple[float, float, bool]:
        """The weight of an uncached token and the weight a holder over its share keeps, for this
        request (``_pick``'s ``w_uncached`` and ``w_spread``), and whether it is a family of its
        own. It is where the deepest prefix a worker holds of it was reused by fewer than
        ``family_min_reuse`` requests lately (``reuse``): both weights are then ``w_miss +
        family_hit_weight`` (its holder keeps it when over its share; the copy a move strands
        there is charged) and the instantaneous guard does not apply (``_pick``'s ``guard``);
        otherwise ``w_miss`` and the compute weight (the module docstring's rule). ``reach``: the
        deepest full-attention depth a worker holds (``PrefixIndex.predict_partial``'s)."""
        w_miss, w_spread = self._shortcut_weights
        cfg = self.config
        if cfg.family_min_reuse <= 0 or not (hits or reach):
            return w_miss, w_spread, False
        count = self.reuse.reused(hashes, self.rules.hash_block_size, reach, hits, now)
        if count == 0.0 or count >= cfg.family_min_reuse:
            return w_miss, w_spread, False
        weight = w_miss + cfg.family_hit_weight
        return weight, weight, True

    def _least_loaded_scan(
        self,
        workers: list[WorkerId],
        credit: dict[WorkerId, float],
        ok: Callable[[WorkerId], bool],
        best_cost: float,
        best: list[WorkerId],
        guarded: bool,
    ) -> tuple[float, list[WorkerId], bool]:
        """``_pick``'s workers without a prefix, by a pass over ``workers``: for a sub-pool (the
        prefill or the decode workers) or when the least loaded of the whole pool are guarded.
        The least loaded ones tie in (the least worked of them when no prefix worker competes)."""
        load_cost = self.book.load_cost
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
        return best_cost, best, guarded

    def _least_worked(self, ties: list[WorkerId]) -> WorkerId:
        """Among equally loaded workers without the prefix, the one assigned the least work lately
        (a new prefix goes where the others are not: idle workers look alike, and a worker that
        already took most recent work holds most prefixes, so another one there evicts them);
        equal work is broken at random (seeded)."""
        now = self._now
        work = {w: self.book.work(w, now) for w in ties}
        least = min(work.values())
        ties = [w for w in ties if work[w] <= least + 1e-6]
        return ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]

    def _guard(self, num_tokens: int, workers: list[WorkerId]) -> tuple[float, float, float]:
        """The guards' thresholds (``LoadBook.thresholds`` states them), each against the mean of
        ``workers`` (the pool the request is placed in: with dedicated prefill and decode workers,
        the other role's load says nothing about this pool's balance). What a holder over its
        share gets is ``_pick``'s rule (its credit at the compute weight)."""
        book = self.book
        queued = book.queued
        if len(workers) == len(queued):
            return book.thresholds(num_tokens, self._now, None, None, None)
        count = max(1, len(workers))
        now = self._now
        cfg = self.config
        mean_queued = sum(map(queued.__getitem__, workers)) / count
        # a mean the thresholds do not read (its check is off) is not computed
        mean_smoothed = sum(book.smoothed(w, now) for w in workers) / count if cfg.load_halflife_s > 0 else 0.0
        mean_work = sum(book.work(w, now) for w in workers) / count if cfg.work_imbalance_ratio else 0.0
        return book.thresholds(num_tokens, now, mean_queued, mean_smoothed, mean_work)

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
        load_cost = self.book.load_cost
        slack = (1.0 - self.config.anchor_credit) * self.rules.alignment
        # the best a pending worker can have: a hit one aligned step below its depth
        contenders = [w for w in deferred if load_cost[w] - weights[w] * (shared[w] - slack) <= best_cost + 1e-9]
        if not contenders:
            return best_cost, best
        self.index.resolve(pending, hits, contenders)
        c = self.config.anchor_credit
        for worker in contenders:
            hit = hits.get(worker, 0)
            cost = load_cost[worker] - weights[worker] * (hit + c * (shared[worker] - hit))
            best_cost, best = better(worker, cost, best_cost, best)
        return best_cost, best

    # -- pins: the owned ``PinKeeper`` places, re-places and revises them -----------------------------
    def pin_configured(
        self, pins: Sequence[PinConfig], tokenize: Callable[[str], list[int]] | None, now: float
    ) -> None:
        """Pin the prefixes of ``router.pins`` (``PinKeeper.pin_configured``)."""
        self.pin_keeper.pin_configured(pins, tokenize, now)

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
        tier: PinTier = "device",
    ) -> tuple[int, list[Action]]:
        """Pin a prefix cluster-wide (``PinKeeper.pin`` states the arguments); returns the pin id and
        the actions placing it."""
        return self.pin_keeper.pin(
            token_ids,
            block_hashes=block_hashes,
            num_tokens=num_tokens,
            replicas=replicas,
            ttl_s=ttl_s,
            now=now,
            pin_id=pin_id,
            tier=tier,
        )

    def unpin(self, pin_id: int, now: float = 0.0) -> list[Action]:
        """Remove a pin everywhere (its capacity is released)."""
        return self.pin_keeper.unpin(pin_id, now)

    def pin_result(
        self, worker: WorkerId, pin_id: int, pinned_tokens: int, now: float = 0.0, seq: int | None = None
    ) -> list[Action]:
        """A ``PinOn`` finished on ``worker`` (``PinKeeper.pin_result``)."""
        return self.pin_keeper.pin_result(worker, pin_id, pinned_tokens, now, seq)

    def pin_info(self) -> list[PinInfo]:
        """Every pin, with the tier each active holder keeps it in now (``PinTable.info``)."""
        return self.pin_keeper.pin_info()

    def tick(self, now: float) -> list[Action]:
        """Time-driven work: pin TTLs, PENDING timeouts, retries, automatic pinning."""
        return self.pin_keeper.tick(now)
