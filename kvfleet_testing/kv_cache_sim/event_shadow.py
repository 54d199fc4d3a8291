"""``EventShadow``: the router's prefix index rebuilt from a coordinator's KV event stream, checked
against the pools after every operation.
"""

from __future__ import annotations

from engine.kv_cache import (
    AllBlocksCleared,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    HybridCoordinator,
)
from engine.kv_cache.block_queue import TIER_NONE
from kvfleet_testing.kv_cache_sim.log import SimLog


class EventShadow:
    """Owns the index a router would build from one coordinator's events: ``_stored`` (group, hash)
    pairs and ``_pinned`` levels per (group, hash) (1 retained, 2 explicit), and ``_last_seq``, the
    last event's sequence number. After ``replay`` the events have arrived gap-free, each naming its
    group's pool, and the shadow equals the managers' hash maps and the pools' pin tiers."""

    def __init__(self, coord: HybridCoordinator, log: SimLog) -> None:
        self._coord = coord
        self._log = log
        self._stored: set[tuple[int, bytes]] = set()
        self._pinned: dict[tuple[int, bytes], int] = {}
        self._last_seq = 0

    def replay(self) -> None:
        """Apply the events since the last replay, then compare with the pools."""
        coord = self._coord
        for event in coord.take_events():
            if event.seq != self._last_seq + 1:
                self._log.fail(f"event sequence gap: {self._last_seq} -> {event.seq}")
            self._last_seq = event.seq
            if not isinstance(event, AllBlocksCleared) and event.pool != coord.group_pool[event.group]:
                self._log.fail(f"{type(event).__name__} of group {event.group} names pool {event.pool}")
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    key = (event.group, h)
                    if key in self._stored:
                        # The pool moved the entry to a fresher copy of the same content; the
                        # hash stays hittable, so a set-based index is unaffected.
                        self._log.tag("stored_again")
                    self._stored.add(key)
            elif isinstance(event, BlockRemoved):
                self._log.tag("evicted")
                for h in event.block_hashes:
                    key = (event.group, h)
                    if key not in self._stored:
                        self._log.fail(f"BlockRemoved for a hash never stored in group {event.group}")
                    if key in self._pinned:
                        self._log.fail(f"BlockRemoved for a pinned hash in group {event.group}")
                    self._stored.discard(key)
            elif isinstance(event, BlockPinned):
                level = 2 if event.explicit else 1
                self._log.tag("pinned_explicit" if event.explicit else "pinned_retained")
                for h in event.block_hashes:
                    key = (event.group, h)
                    if key not in self._stored or self._pinned.get(key, 0) >= level:
                        self._log.fail(f"BlockPinned(explicit={event.explicit}) for an unstored or already pinned hash")
                    self._pinned[key] = level
            elif isinstance(event, BlockUnpinned):
                for h in event.block_hashes:
                    key = (event.group, h)
                    if key not in self._pinned:
                        self._log.fail(f"BlockUnpinned for a hash that is not pinned (group {event.group})")
                    del self._pinned[key]
            elif isinstance(event, AllBlocksCleared):
                self._stored.clear()
                self._pinned.clear()
        actual = {(g, h) for g, m in enumerate(coord.managers) for h in m.cached}
        if actual != self._stored:
            self._log.fail(
                f"event replay disagrees with the pool: {len(actual - self._stored)} cached but not announced, "
                f"{len(self._stored - actual)} announced but not cached"
            )
        pins = {(b.group, b.block_hash): b.tier for pool in coord.pools for b in pool.blocks if b.tier != TIER_NONE}
        if pins != self._pinned:
            self._log.fail(
                f"event replay disagrees with pin levels: {len(pins)} pinned vs {len(self._pinned)} announced"
            )
