"""Prefixes the router has sent to a worker whose KV that worker has not reported yet.

A worker reports a prompt's blocks only after computing them, so for the whole prefill of a new
prefix (seconds on a CPU) the index does not know where it is going. Without this, a second
request with the same prefix arriving meanwhile sees no holder, may land on another worker and
compute the prefix a second time (two misses instead of one, and two copies in the cluster).
Prefix-tree routers avoid that by inserting the prompt when they route it; this is the same idea
kept apart from the exact index: it steers placement only, never the predicted hit (which stays
what the worker's coordinator will find), and its entries end when the worker reports the blocks
or after ``ttl_s`` (the request failed, or waited that long).

Block hashes are chained (a block's hash commits to every token before it), so two hash lists
that agree at position i agree everywhere before it: the blocks two prompts share are found by a
binary search, and an announcement is stored once, under the hash of its first block.

``InFlightPrefixes`` is the interface; ``PyInFlightPrefixes`` the reference, and
``engine/routing/_inflight.c`` the compiled one (built at install time, optional like the holder
maps' core; ``make_inflight`` picks one by ``KVFLEET_ROUTING_CORE``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

from engine.routing.holder_maps import compiled_core
from engine.routing.types import WorkerId


class _Sent:
    """Blocks [start, end) of one routed prompt, announced for ``worker``: ``hashes`` holds their
    hashes (block i's at ``hashes[i - start]``)."""

    __slots__ = ("end", "expiry", "hashes", "start", "worker")

    def __init__(self, worker: WorkerId, hashes: Sequence[bytes], start: int, end: int, expiry: float):
        self.worker = worker
        self.hashes = hashes
        self.start = start
        self.end = end
        self.expiry = expiry


class InFlightPrefixes(Protocol):
    """Announcements "worker w will hold blocks [start, end) of this prompt", with an expiry:
    ``PyInFlightPrefixes`` documents each call; the compiled tracker answers every call alike
    (the order of a ``depths`` result included: the pick's ties read it)."""

    @property
    def ttl_s(self) -> float: ...

    def __len__(self) -> int: ...

    def __bool__(self) -> bool: ...

    def add(self, worker: WorkerId, block_hashes: Sequence[bytes], start: int, end: int, now: float) -> None: ...

    def announced(self, worker: WorkerId) -> bool: ...

    def expire(self, now: float) -> None: ...

    def depths(
        self, block_hashes: Sequence[bytes], now: float, known: Mapping[WorkerId, int] | None = None
    ) -> dict[WorkerId, int]: ...

    def discard(self, worker: WorkerId, block_hashes: Sequence[bytes]) -> None: ...

    def forget_worker(self, worker: WorkerId) -> None: ...


class PyInFlightPrefixes:
    """Announcements "worker w will hold blocks [start, end) of this prompt", with an expiry.

    Owns the announcements, keyed by the hash of their first block, and a FIFO of them by expiry
    (the TTL is fixed, so adding in time order keeps it sorted), and per worker the keys of its
    announcements with their counts. Invariants: every keyed announcement is in the FIFO; none is
    keyed once ``expire`` ran past its expiry; none of a worker is keyed under a hash that worker
    has since reported (``discard``); ``_keys[w][k]`` is the number of w's announcements keyed
    under k (absent: none). ``add`` is O(announced blocks) (it keeps a copy of their hashes only),
    ``depths`` O(log blocks) per announcement met, ``discard`` O(the worker's announcement keys x
    reported blocks): a reported hash is compared, never hashed (a worker's report holds fresh
    hash objects whose hashes nobody computed yet).
    """

    def __init__(self, ttl_s: float):
        if ttl_s < 0:
            raise ValueError(f"inflight_ttl_s: must be >= 0 (got {ttl_s})")
        self.ttl_s = ttl_s
        self._by_start: dict[bytes, list[_Sent]] = {}
        self._fifo: deque[_Sent] = deque()
        self._keys: dict[WorkerId, dict[bytes, int]] = {}

    def __len__(self) -> int:
        """Announcements still keyed (expired ones count until ``expire`` runs)."""
        return sum(map(len, self._by_start.values()))

    def __bool__(self) -> bool:
        return bool(self._by_start)

    def add(self, worker: WorkerId, block_hashes: Sequence[bytes], start: int, end: int, now: float) -> None:
        """``worker`` will hold ``block_hashes[start:end]`` soon (it holds the blocks before)."""
        if start < 0:
            raise ValueError(f"start: must be >= 0 (got {start})")
        end = min(end, len(block_hashes))
        if self.ttl_s == 0 or start >= end:
            return
        sent = _Sent(worker, block_hashes[start:end], start, end, now + self.ttl_s)
        key = block_hashes[start]
        listed = self._by_start.get(key)
        if listed is None:
            self._by_start[key] = [sent]
        else:
            listed.append(sent)
        self._fifo.append(sent)
        keys = self._keys.get(worker)
        if keys is None:
            self._keys[worker] = {key: 1}
        else:
            keys[key] = keys.get(key, 0) + 1

    def announced(self, worker: WorkerId) -> bool:
        """Whether ``worker`` has an announcement keyed (expired ones count until ``expire`` runs)."""
        return worker in self._keys

    def expire(self, now: float) -> None:
        """Drop the announcements whose expiry has passed."""
        fifo = self._fifo
        while fifo and fifo[0].expiry <= now:
            self._unkey(fifo.popleft())

    def depths(
        self, block_hashes: Sequence[bytes], now: float, known: Mapping[WorkerId, int] | None = None
    ) -> dict[WorkerId, int]:
        """Per worker, how many leading blocks of ``block_hashes`` it will hold: the ``known``
        blocks it holds (the index's view; 0 if absent) extended by an announcement that starts
        right there. Only workers such an announcement extends are returned."""
        self.expire(now)
        by_start = self._by_start
        if not by_start or not block_hashes:
            return {}
        n = len(block_hashes)
        depth: dict[WorkerId, int] = {}
        for sent in by_start.get(block_hashes[0], ()):
            if not known or not known.get(sent.worker, 0):
                _deepen(depth, sent, block_hashes, n)
        if known:
            for worker, start in known.items():
                if 0 < start < n:
                    for sent in by_start.get(block_hashes[start], ()):
                        if sent.worker == worker and sent.start == start:
                            _deepen(depth, sent, block_hashes, n)
        return depth

    def discard(self, worker: WorkerId, block_hashes: Sequence[bytes]) -> None:
        """``worker`` reported these blocks: announcements of it starting at one of them end
        (the index knows those blocks now)."""
        keys = self._keys.get(worker)
        if keys:
            for key in [k for k in keys if k in block_hashes]:
                self._end(worker, key)

    def forget_worker(self, worker: WorkerId) -> None:
        """Drop every announcement of ``worker`` (it left, or its cache was cleared)."""
        for key in list(self._keys.get(worker, ())):
            self._end(worker, key)

    def _end(self, worker: WorkerId, key: bytes) -> None:
        """Unkey every announcement of ``worker`` under ``key``."""
        listed = self._by_start.get(key)
        if listed is not None:
            kept = [s for s in listed if s.worker != worker]
            if not kept:
                del self._by_start[key]
            elif len(kept) != len(listed):
                self._by_start[key] = kept
        keys = self._keys[worker]
        del keys[key]
        if not keys:
            del self._keys[worker]

    def _unkey(self, sent: _Sent) -> None:
        key = sent.hashes[0]
        listed = self._by_start.get(key)
        if listed is None:
            return
        for i, other in enumerate(listed):
            if other is sent:
                del listed[i]
                if not listed:
                    del self._by_start[key]
                keys = self._keys[sent.worker]
                keys[key] -= 1
                if not keys[key]:
                    del keys[key]
                    if not keys:
                        del self._keys[sent.worker]
                return


def make_inflight(ttl_s: float, core: str | None = None) -> InFlightPrefixes:
    """The in-flight prefixes, compiled or not as ``holder_maps.compiled_core`` says
    (``KVFLEET_ROUTING_CORE`` by default, the variable that picks the holder maps)."""
    compiled = compiled_core("_inflight", "InFlightPrefixes", core)
    if compiled is None:
        return PyInFlightPrefixes(ttl_s)
    tracker: InFlightPrefixes = compiled(ttl_s)
    return tracker


def _deepen(depth: dict[WorkerId, int], sent: _Sent, block_hashes: Sequence[bytes], n: int) -> None:
    """Fold in how far ``sent`` agrees with ``block_hashes`` (chained: agreement is a prefix)."""
    start = sent.start
    lo, hi = start + 1, min(sent.end, n)  # agreement is known at sent.start
    mine = sent.hashes
    while lo < hi:  # first position in [lo, hi) where they differ, else hi
        mid = (lo + hi) // 2
        if mine[mid - start] == block_hashes[mid]:
            lo = mid + 1
        else:
            hi = mid
    if lo > depth.get(sent.worker, 0):
        depth[sent.worker] = lo
