"""Prefixes the router has sent to a worker whose KV that worker has not reported yet.

A worker reports a prompt's blocks only after computing them, so for the whole prefill of a new
prefix (seconds on a CPU) the index does not know where it is going. Without this, a second
request with the same prefix arriving meanwhile sees no holder, may land on another worker and
compute the prefix a second time (two misses instead of one, and two copies in the cluster).
Prefix-tree routers avoid that by inserting the prompt when they route it; this is the same idea
kept apart from the exact index: it steers placement only, never the predicted hit (which stays
what the worker's coordinator will find), and its entries expire after ``ttl_s`` (by then the
worker's own events describe the blocks, or the request failed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine.routing.types import WorkerId


class InFlightPrefixes:
    """Block hashes recently routed to each worker, with an expiry.

    Owns ``block hash -> {worker: expiry}`` and a FIFO of the same entries by expiry (the TTL is
    fixed, so adding in time order keeps the FIFO sorted). Invariants: every map entry has a FIFO
    record with the same expiry (re-adding refreshes the map and leaves a stale record that
    ``expire`` skips); no map entry outlives its expiry once ``expire`` has run at a later time.
    ``add`` and ``depths`` cost O(the request's blocks x workers sharing them).
    """

    def __init__(self, ttl_s: float):
        if ttl_s < 0:
            raise ValueError(f"inflight_ttl_s: must be >= 0 (got {ttl_s})")
        self.ttl_s = ttl_s
        self._by_hash: dict[bytes, dict[WorkerId, float]] = {}
        self._fifo: deque[tuple[float, bytes, WorkerId]] = deque()

    def __len__(self) -> int:
        return len(self._by_hash)

    def add(self, worker: WorkerId, block_hashes: Sequence[bytes], now: float) -> None:
        """``worker`` will hold ``block_hashes`` (a prompt's leading full blocks) soon."""
        if self.ttl_s == 0:
            return
        expiry = now + self.ttl_s
        by_hash, fifo = self._by_hash, self._fifo
        for block_hash in block_hashes:
            holders = by_hash.get(block_hash)
            if holders is None:
                by_hash[block_hash] = {worker: expiry}
            else:
                holders[worker] = expiry
            fifo.append((expiry, block_hash, worker))

    def expire(self, now: float) -> None:
        """Drop the entries whose expiry has passed."""
        by_hash, fifo = self._by_hash, self._fifo
        while fifo and fifo[0][0] <= now:
            expiry, block_hash, worker = fifo.popleft()
            holders = by_hash.get(block_hash)
            if holders is not None and holders.get(worker) == expiry:
                del holders[worker]
                if not holders:
                    del by_hash[block_hash]

    def depths(self, block_hashes: Sequence[bytes], now: float) -> dict[WorkerId, int]:
        """Per worker, how many leading blocks of ``block_hashes`` were routed to it (>= 1)."""
        self.expire(now)
        by_hash = self._by_hash
        if not block_hashes or block_hashes[0] not in by_hash:
            return {}
        alive = set(by_hash[block_hashes[0]])
        depth: dict[WorkerId, int] = {}
        for i, block_hash in enumerate(block_hashes[1:], start=1):
            holders = by_hash.get(block_hash)
            for worker in [w for w in alive if holders is None or w not in holders]:
                alive.discard(worker)
                depth[worker] = i
            if not alive:
                return depth
        for worker in alive:
            depth[worker] = len(block_hashes)
        return depth

    def discard(self, worker: WorkerId, block_hashes: Sequence[bytes]) -> None:
        """``worker`` reported these blocks (the index knows them now) or dropped them."""
        by_hash = self._by_hash
        for block_hash in block_hashes:
            holders = by_hash.get(block_hash)
            if holders is not None and holders.pop(worker, None) is not None and not holders:
                del by_hash[block_hash]

    def forget_worker(self, worker: WorkerId) -> None:
        """Drop every entry of ``worker`` (it left, or its cache was cleared)."""
        for block_hash in [h for h, holders in self._by_hash.items() if worker in holders]:
            holders = self._by_hash[block_hash]
            del holders[worker]
            if not holders:
                del self._by_hash[block_hash]
