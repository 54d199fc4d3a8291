"""Which shared prefixes the routed traffic starts with (``HotPrefixes``): what the policy's
automatic pin mode pins.

Split out of ``engine.routing.pins``; pure counting over block hashes, independent of the pin table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class HotPrefix:
    """A shared prefix seen in the traffic: keyed by the hash of its last block, with its decayed count."""

    key: bytes
    block_hashes: list[bytes]
    length: int
    count: float = 0.0


class HotPrefixes:
    """Which shared prefixes routed requests start with, counted with a half-life.

    A request's *shared prefix* is the deepest aligned block of it that an earlier request (within
    about two half-lives) also had: where its chain diverged from the traffic seen before. Cost per
    request: O(its prefix blocks) set operations.

    Invariants: ``_recent`` and ``_older`` each hold a chain's aligned hashes only with those before
    them (closed under prefixes, which ``observe``'s binary search relies on);
    ``counts[key].block_hashes[-1] == key``, its ``length`` a multiple of ``step`` hash blocks;
    every count is positive.
    """

    def __init__(self, hash_block_size: int, alignment: int, half_life_s: float = 30.0):
        self.step = max(1, alignment // hash_block_size)
        self.hash_block_size = hash_block_size
        self.half_life_s = half_life_s
        self.counts: dict[bytes, HotPrefix] = {}
        self._recent: set[bytes] = set()
        self._older: set[bytes] = set()
        self._rotated_at: float | None = None

    def observe(self, block_hashes: Sequence[bytes], now: float) -> None:
        if self._rotated_at is None:
            self._rotated_at = now
        step = self.step
        recent, older = self._recent, self._older
        # Each request adds its whole chain to one set, so membership in either set is closed
        # under prefixes (a chained hash implies every hash before it): binary search the
        # number of aligned steps seen before.
        lo, hi = 0, len(block_hashes) // step
        while lo < hi:
            mid = (lo + hi + 1) // 2
            block_hash = block_hashes[mid * step - 1]
            if block_hash in recent or block_hash in older:
                lo = mid
            else:
                hi = mid - 1
        deepest = lo * step
        if deepest and block_hashes[deepest - 1] in recent:  # the shared part is there already
            recent.update(block_hashes[deepest + step - 1 :: step])
        else:
            recent.update(block_hashes[step - 1 :: step])
        if not deepest:
            return
        key = block_hashes[deepest - 1]
        hot = self.counts.get(key)
        if hot is None:
            hot = self.counts[key] = HotPrefix(key, list(block_hashes[:deepest]), deepest * self.hash_block_size)
        hot.count += 1.0

    def decay(self, now: float) -> None:
        """Halve every count once per half-life and forget prefixes seen two half-lives ago."""
        if self._rotated_at is None or now - self._rotated_at < self.half_life_s:
            return
        self._rotated_at = now
        self._older, self._recent = self._recent, set()
        for key in [k for k, hot in self.counts.items() if hot.count < 0.5]:
            del self.counts[key]
        for hot in self.counts.values():
            hot.count *= 0.5
