"""The router actor: engine.routing's placement policy behind a Ray actor.

It owns the policy object (prefix index, loads, pins) and the worker handles, and it executes
the actions the policy returns by calling the workers without waiting (``PinOn`` -> ``pin``,
``Unpin`` -> ``unpin``, ``RequestSnapshot`` -> ``snapshot``); workers answer with their own
calls (``pin_result``, ``apply_snapshot``). The router never blocks on a worker, so a worker may
wait for the router (it does, before handing out a finished request) without a deadlock.

A plain (non-async) actor with one thread: calls run one at a time in arrival order, and calls
from one caller in the order that caller made them, so a worker's reports apply in sequence.

Replicas (``router.replicas`` > 1, docs/architecture.md, Router replicas): every replica keeps
the full index from every worker's reports and routes what the drivers send it (a request goes
to the replica its first block's hash picks). One replica at a time, the holder of the pin
lease (``actors.pin_lease``), keeps the pin table: it alone places, re-places, expires and
journals pins and runs the automatic pins; the others refuse pin calls (``NotPinLeaderError``)
and see pins as the workers report their pinned blocks. A replica that takes the lease over
restores the journaled pins, as a restarted single router does.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import ray

from actors.pin_journal import JournaledPin, PinJournal
from actors.pin_lease import PinLease
from actors.router_link import unpack_report
from configs.schema import ClusterConfig
from engine.kv_cache.coordinator_types import PinTier
from engine.kv_cache.spec import KVCacheGroup
from engine.routing import (
    Action,
    Decision,
    PinOn,
    RequestSnapshot,
    RouteOutcomes,
    RouteRequest,
    RoutingPolicy,
    Unpin,
    build_router,
)
from engine.routing.types import Role

log = logging.getLogger(__name__)

TICK_INTERVAL_S = 0.5


class NotPinLeaderError(RuntimeError):
    """A pin call reached a router replica that does not decide pins; ``leader``: the one that
    does (None: none holds the lease now)."""

    def __init__(self, replica: int, leader: int | None):
        super().__init__(f"router replica {replica} does not decide pins (the pin lease is with {leader})")
        self.replica = replica
        self.leader = leader


@ray.remote
class Router:
    """Owns one routing policy and the handles of the workers registered with it.

    Invariants: every worker registered with the policy has a handle here; time passed to the
    policy is this process's monotonic clock; pins given in the config are created by the driver
    (it has the tokenizer), so the policy starts without them; every explicit pin is journaled
    (``cluster_key`` given), so a restarted router (a new ``incarnation``) restores them under
    their ids once enough workers have registered again, while the process that started the
    cluster registers the workers and has them send full snapshots. Of several replicas only the
    one ``leading`` (holding the pin lease) ticks the policy and executes pin actions; a replica
    restores the journal each time it starts leading (a single router leads from its start).
    """

    def __init__(self, config: ClusterConfig, groups: Sequence[KVCacheGroup], cluster_key: str = "", replica: int = 0):
        from configs.logs import setup_logging

        setup_logging(config.logging)
        router_config = config.router.model_copy(update={"pins": []})
        self.policy = build_router(router_config, list(groups), now=time.monotonic())
        #: the policy again when it keeps cluster pins (kvfleet's); baselines keep none
        self.pin_policy: RoutingPolicy | None = self.policy if isinstance(self.policy, RoutingPolicy) else None
        self.handles: dict[str, Any] = {}
        self.reasons: Counter[str] = Counter()
        self.outcomes = RouteOutcomes()
        self.routed = 0
        self.disaggregated = 0
        self.predicted_hit_tokens = 0
        #: predicted hit tokens placements gave up (the best worker's hit less the chosen one's)
        self.hit_tokens_given_up = 0
        self.prompt_tokens = 0
        self._last_tick = 0.0
        self.metrics = _router_metrics()
        self.incarnation = uuid.uuid4().hex
        self.journal = PinJournal(cluster_key) if cluster_key else None
        self._to_restore: list[JournaledPin] = []
        self.replica = replica
        #: the pin lease, with several replicas (one alone leads: see the module docstring)
        self.lease = PinLease(cluster_key or "default", replica) if config.router.replicas > 1 else None
        self.leading = False
        if self.lease is not None:
            self.lease.start()
        self._check_leading()

    def _check_leading(self) -> bool:
        """Whether this replica decides the pins now; on becoming the leader, restore the
        journaled pins (a restarted router's, or a lost leader's)."""
        leads = self.lease is None or self.lease.held()
        if leads and not self.leading and self.journal is not None:
            self._to_restore = self.journal.load()
            if self._to_restore:
                log.warning(
                    "router replica %d leads the pins: %d to restore once workers register",
                    self.replica,
                    len(self._to_restore),
                )
        elif self.leading and not leads:
            log.error("router replica %d lost the pin lease; another replica decides the pins", self.replica)
            self._to_restore = []
        self.leading = leads
        return leads

    def ready(self) -> str:
        return self.policy.name

    def identity(self) -> str:
        """This router process's incarnation: it changes when Ray restarts the router."""
        return self.incarnation

    # -- membership --------------------------------------------------------------------------------
    def add_worker(self, worker_id: str, role: Role, num_blocks: int, handle: Any) -> None:
        """Register a worker (a replacement takes over its predecessor's id and nothing else)."""
        if worker_id in self.handles:
            self.remove_worker(worker_id)
        self.handles[worker_id] = handle
        actions = self.policy.add_worker(worker_id, role, num_blocks, now=time.monotonic())
        self._execute(actions)
        if self._to_restore and self._check_leading():
            self._restore_pins()

    def _restore_pins(self) -> None:
        """Place the journaled pins again (those whose replicas the registered workers allow)."""
        pending = []
        for entry in self._to_restore:
            ttl = entry.ttl_left()
            if ttl is not None and ttl <= 0:
                assert self.journal is not None
                self.journal.forget(entry.pin_id)
                continue
            try:
                assert self.pin_policy is not None  # journaled pins exist only under a pin policy
                _, actions = self.pin_policy.pin(
                    list(entry.token_ids),
                    replicas=entry.replicas,
                    ttl_s=ttl,
                    now=time.monotonic(),
                    pin_id=entry.pin_id,
                    tier=entry.tier,
                )
            except ValueError as exc:  # e.g. not enough workers registered yet
                log.debug("pin %d not restored yet: %s", entry.pin_id, exc)
                pending.append(entry)
                continue
            self._execute(actions)
            log.warning("restored pin %d (%d tokens x %d)", entry.pin_id, len(entry.token_ids), entry.replicas)
        self._to_restore = pending
        self._update_pin_gauges()

    def remove_worker(self, worker_id: str, actor_id: str | None = None) -> None:
        """Forget a worker and place its pins elsewhere. ``actor_id``: only if that actor still
        holds the id (a driver that saw the old one fail must not remove its replacement)."""
        handle = self.handles.get(worker_id)
        if handle is None or (actor_id is not None and handle._actor_id.hex() != actor_id):
            return
        self._execute(self.policy.remove_worker(worker_id, now=time.monotonic()))
        self.handles.pop(worker_id, None)

    def worker_handles(self) -> dict[str, Any]:
        """The registered workers' actor handles (drivers attached later adopt replacements)."""
        return dict(self.handles)

    # -- reports from workers ----------------------------------------------------------------------
    def report(self, worker_id: str, packed: bytes) -> None:
        """A worker's new KV events and current load (``actors.router_link.pack_report``)."""
        now = time.monotonic()
        events, load = unpack_report(packed)
        if events:
            self._execute(self.policy.apply_events(worker_id, events, now))
        self.policy.update_load(worker_id, load)
        self._maybe_tick(now)

    def apply_snapshot(self, worker_id: str, snapshot: Any) -> None:
        self._execute(self.policy.apply_snapshot(worker_id, snapshot, time.monotonic()))

    def pin_result(self, worker_id: str, pin_id: int, pinned_tokens: int, seq: int | None = None) -> None:
        if self.pin_policy is not None and self.leading:  # (every replica hears it; the leader placed it)
            self._execute(self.pin_policy.pin_result(worker_id, pin_id, pinned_tokens, time.monotonic(), seq))

    # -- placement ---------------------------------------------------------------------------------
    def route(
        self, request_id: str, block_hashes: list[bytes], num_tokens: int, max_tokens: int | None = None
    ) -> Decision:
        """Where ``request_id`` runs: its prefill and decode workers and the predicted hit
        (``max_tokens``: the request's, when the caller gives it; ``RouteRequest``)."""
        now = time.monotonic()
        self._maybe_tick(now)
        decision = self.policy.route(RouteRequest(request_id, block_hashes, num_tokens, max_tokens), now)
        self.routed += 1
        self.reasons[decision.reason] += 1
        self.outcomes.record(decision)
        log.debug(
            "route %s: %s -> %s/%s, hit %d of %d (best %d)",
            request_id,
            decision.reason,
            decision.prefill_worker,
            decision.decode_worker,
            decision.predicted_hit,
            num_tokens,
            decision.best_hit,
        )
        # the driver hands the predicted hit to the worker with the request itself (``expected``
        # of ``EngineWorker.generate`` / ``prefill``): no call of the router's own per request
        split = decision.prefill_worker != decision.decode_worker
        self.disaggregated += split
        self.prompt_tokens += num_tokens
        self.predicted_hit_tokens += decision.predicted_hit
        given_up = max(0, decision.best_hit - decision.predicted_hit)
        self.hit_tokens_given_up += given_up
        if self.metrics is not None:
            predicted = min(decision.predicted_hit, num_tokens)
            self.metrics.record_request_routed(num_tokens, predicted, disaggregated=split, given_up_tokens=given_up)
        return decision

    def route_many(self, requests: list[tuple[str, list[bytes], int, int | None]]) -> list[Decision]:
        """``route`` for each of several requests (id, block hashes, tokens, max_tokens), in order:
        a driver's requests that came while its previous call was in flight (``cluster.route_batch``)."""
        return [self.route(*request) for request in requests]

    def finished(self, requests: list[tuple[float, int, bool]]) -> None:
        """A driver reports the ends of its requests, batched (for the router's metrics): per
        request its TTFT in seconds, its output tokens and whether it succeeded."""
        if self.metrics is None:
            return
        for ttft_s, output_tokens, ok in requests:
            if ok:
                self.metrics.record_request_finished(max(0.0, ttft_s), max(0, output_tokens))
            else:
                self.metrics.record_request_failed()

    # -- pins --------------------------------------------------------------------------------------
    def pin(self, token_ids: list[int], replicas: int = 1, ttl_s: float | None = None, tier: PinTier = "device") -> int:
        """Pin a prefix on ``replicas`` workers (optionally for ``ttl_s``), each keeping it in
        ``tier`` (checked by the caller: ``Cluster.pin_prefix``); returns the pin id."""
        if self.pin_policy is None:
            raise ValueError(f"router.policy: {self.policy.name!r} does not support pinned prefixes (use kvfleet)")
        self._require_leading()
        pin_id, actions = self.pin_policy.pin(
            token_ids, replicas=replicas, ttl_s=ttl_s, now=time.monotonic(), tier=tier
        )
        if self.journal is not None:
            self.journal.record(int(pin_id), token_ids, replicas, ttl_s, tier)
        self._execute(actions)
        self._update_pin_gauges()
        return int(pin_id)

    def unpin(self, pin_id: int) -> bool:
        if self.pin_policy is None:
            return False
        self._require_leading()
        known = any(info.pin_id == pin_id for info in self.pin_policy.pin_info())
        pending = [entry for entry in self._to_restore if entry.pin_id != pin_id]
        known = known or len(pending) < len(self._to_restore)
        self._to_restore = pending
        self._execute(self.pin_policy.unpin(pin_id, now=time.monotonic()))
        if self.journal is not None:
            self.journal.forget(pin_id)
        self._update_pin_gauges()
        return known

    def pins(self) -> list[dict[str, Any]]:
        """Every cluster pin: id, length, replicas, active and pending holders, where each active
        holder keeps it (``holder_tiers``: worker -> "device" / "host"), expiry."""
        now = time.monotonic()
        self._maybe_tick(now)
        if self.pin_policy is None or not self.leading:
            return []
        return [
            {
                "pin_id": info.pin_id,
                "num_tokens": info.num_tokens,
                "replicas": info.replicas,
                "active": [str(w) for w in info.active],
                "pending": [str(w) for w in info.pending],
                "tier": info.tier,
                "holder_tiers": {str(w): tier for w, tier in info.holder_tiers.items()},
                "expires_at": info.expires_at,
                "expires_in_s": None if info.expires_at is None else max(0.0, info.expires_at - now),
                "auto": info.auto,
            }
            for info in self.pin_policy.pin_info()
        ]

    def pin_leader(self) -> int | None:
        """The replica that decides pins now (claiming the lease first when it is free)."""
        if self.lease is None:
            return self.replica
        self.lease.refresh()
        self._check_leading()
        return self.lease.leader()

    def _require_leading(self) -> None:
        if self.lease is not None and not self.leading:
            self.lease.refresh()
        if not self._check_leading():
            raise NotPinLeaderError(self.replica, self.lease.leader() if self.lease is not None else None)

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "replica": self.replica,
            "routed": self.routed,
            "disaggregated": self.disaggregated,
            "reasons": dict(self.reasons),
            "route_outcomes": self.outcomes.as_dict(),
            "prompt_tokens": self.prompt_tokens,
            "predicted_hit_tokens": self.predicted_hit_tokens,
            "hit_tokens_given_up": self.hit_tokens_given_up,
            "pins": self.pins(),
            "loads": {str(w): vars(load) for w, load in self.policy.loads.items()},
        }

    # -- internals ---------------------------------------------------------------------------------
    def _maybe_tick(self, now: float) -> None:
        if now - self._last_tick >= TICK_INTERVAL_S:
            self._last_tick = now
            if self._check_leading():
                if self._to_restore:
                    self._restore_pins()
                self._execute(self.policy.tick(now))

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            handle = self.handles.get(str(action.worker))
            if handle is None:
                continue
            if isinstance(action, (PinOn, Unpin)) and not self.leading:
                continue  # the replica holding the pin lease places pins
            if isinstance(action, PinOn):  # with the holder to copy from, when there is one
                source = self.handles.get(str(action.source)) if action.source is not None else None
                handle.pin.remote(action, source)
            elif isinstance(action, Unpin):
                handle.unpin.remote(action.block_hashes, action.num_tokens, action.tier)
            elif isinstance(action, RequestSnapshot):
                handle.snapshot.remote(self.replica)
        if actions:
            self._update_pin_gauges()

    def _update_pin_gauges(self) -> None:
        if self.metrics is None or self.pin_policy is None:
            return
        infos = self.pin_policy.pin_info()
        blocks = sum(info.blocks_per_replica * len(info.active) for info in infos)
        self.metrics.set_pin_stats(len(infos), blocks)


def _router_metrics() -> Any:
    try:
        from actors.metrics import RouterMetrics

        return RouterMetrics()
    except Exception as exc:  # noqa: BLE001 - metrics must never stop the router
        log.warning("router: no metrics (%s)", exc)
        return None
