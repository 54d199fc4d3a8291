"""Prefixes routed to a worker and not yet reported by it, as the routing policy reads them.

``RoutedPrefixes`` is owned by ``RoutingPolicy`` (at ``RoutingPolicy.routed``): it keeps the
in-flight tracker (``inflight.make_inflight``: the Python reference or the compiled twin) in the
hash space of the first checked group, announces each decision's prompt on its workers, ends an
announcement when the worker's KV events report those blocks, and says how far each worker will
hold a prompt once what was routed to it has run (``ahead``, the policy's in-flight credit).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache.events import AllBlocksCleared, BlockStored, KVEvent
from engine.kv_cache.hashing import coarse_view
from engine.routing.hit_rules import HitRules
from engine.routing.inflight import InFlightPrefixes, make_inflight
from engine.routing.types import Decision, WorkerId


class RoutedPrefixes:
    """The in-flight tracker (``store``) with the group and block size its hashes are in.

    Invariant: an announced block is forgotten once its worker reports it (``forget_reported``),
    loses its cache, leaves (``forget_worker``) or its announcement expires (``ttl_s``)."""

    def __init__(self, rules: HitRules, ttl_s: float):
        self.rules = rules
        self.store: InFlightPrefixes = make_inflight(ttl_s)
        self.group = rules.order[0]
        self.block = rules.block_sizes[self.group]
        self._factor = rules.managers[self.group].hash_factor  # a prompt's hashes in that group: its view

    def __bool__(self) -> bool:
        return bool(self.store)

    def view(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The prompt's block hashes in the tracker's group (``KVCacheManager.view``'s rule, one
        call less on the decision's path)."""
        return coarse_view(hashes if isinstance(hashes, list) else list(hashes), self._factor)

    def forget_worker(self, worker: WorkerId) -> None:
        self.store.forget_worker(worker)

    def forget_reported(self, worker: WorkerId, events: list[KVEvent]) -> None:
        """Blocks a worker reports are the index's business from now on (so an in-flight entry
        never outlives the blocks it announced); a cleared cache drops them all."""
        inflight = self.store
        group = self.group
        for event in events:
            if not inflight.announced(worker):
                return  # nothing (left) to end
            if isinstance(event, BlockStored) and event.group == group:
                inflight.discard(worker, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                inflight.forget_worker(worker)

    def ahead(self, view: list[bytes], num_tokens: int, shared: dict[WorkerId, int], now: float) -> dict[WorkerId, int]:
        """Tokens of this prompt each worker will hold once the requests routed to it have run
        (what it holds, extended by what it was sent and has not reported), aligned like a hit
        and below N; only workers with such unreported blocks (none while nothing is in flight)."""
        if not self.store:
            return {}
        block = self.block
        known = {w: depth // block for w, depth in shared.items()} if shared else None
        depths = self.store.depths(view, now, known)
        if not depths:
            return {}
        cap = self.rules.aligned(num_tokens - 1)
        return {w: min(cap, self.rules.aligned(d * block)) for w, d in depths.items()}

    def announce(
        self, decision: Decision, view: list[bytes], shared: dict[WorkerId, int], num_tokens: int, now: float
    ) -> None:
        """Both workers of ``decision`` will hold the prompt's first N - 1 tokens (computed, or
        pulled by the decode worker); the part each already holds is the index's business. (``add``
        copies the announced blocks' hashes: the list is the caller's.)"""
        inflight = self.store
        if inflight.ttl_s > 0:
            block = self.block
            end = (num_tokens - 1) // block
            prefill, decode = decision.prefill_worker, decision.decode_worker
            inflight.add(prefill, view, shared.get(prefill, 0) // block, end, now)
            if decode != prefill:
                inflight.add(decode, view, shared.get(decode, 0) // block, end, now)
