"""How often each cached prefix is reused lately (``PrefixReuse``): what tells the routing policy
whether a prefix family is popular enough that a second copy of it pays.

A request *reuses* the deepest prefix of it some worker holds (the longest full-attention depth
the index found, else the longest hit); that prefix is keyed by the hash of its last block. A
prefix many requests reuse (a system prompt, a shared document) keeps its holder busy by itself,
and a copy on a second worker serves the requests after it. A prefix only one request reuses (the
previous turn of one conversation) is a family of its own: sending that request elsewhere loses
its hit and helps nobody after it, as the family's next turn follows the new copy.

Two implementations of one interface (``ReuseCounts``): ``PrefixReuse`` below, the reference, and
the compiled ``engine.routing._reuse.PrefixReuse`` (``_reuse.c``, the same counts call by call;
``make_prefix_reuse`` picks one like ``holder_maps.make_holder_maps``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.routing.decay import decayed
from engine.routing.holder_maps import compiled_core
from engine.routing.types import WorkerId


class ReuseCounts(Protocol):
    """Per reused prefix, how many requests reused it lately (``PrefixReuse`` states the rules)."""

    def __len__(self) -> int: ...
    def observe(self, key: bytes, now: float) -> float: ...
    def reused(
        self, hashes: Sequence[bytes], hash_block_size: int, depth: int, hits: dict[WorkerId, int], now: float
    ) -> float: ...


class PrefixReuse:
    """Per reused prefix (keyed by its last block's hash): how many requests reused it, each one
    decaying with half-life ``halflife_s``.

    Invariants: at most ``capacity`` prefixes are kept, the least recently reused dropped first
    (``_counts`` is in order of last reuse); a count is what it was at ``_counts[key][1]``."""

    def __init__(self, halflife_s: float, capacity: int = 1 << 16):
        if halflife_s <= 0:
            raise ValueError(f"halflife_s: must be > 0 (got {halflife_s})")
        self.halflife_s = halflife_s
        self.capacity = capacity
        self._counts: dict[bytes, tuple[float, float]] = {}  # key -> (count, at), in order of last reuse

    def __len__(self) -> int:
        return len(self._counts)

    def observe(self, key: bytes, now: float) -> float:
        """Count one more reuse of the prefix ``key`` at ``now``; returns its count with it (the
        earlier ones decayed to ``now`` by ``decay.decayed``, the rule the work guard's counts
        follow)."""
        counts = self._counts
        old = counts.pop(key, None)
        if old is None:
            count, at = 1.0, now
        else:
            count, at = 1.0 + decayed(old[0], old[1], now, self.halflife_s), max(now, old[1])
        counts[key] = (count, at)
        if len(counts) > self.capacity:
            del counts[next(iter(counts))]  # the least recently reused
        return count

    def reused(
        self, hashes: Sequence[bytes], hash_block_size: int, depth: int, hits: dict[WorkerId, int], now: float
    ) -> float:
        """Count the reuse of the deepest prefix of ``hashes`` a worker holds (``depth``: the
        deepest full-attention depth, found by the index's walk; where 0, the longest of ``hits``;
        tokens) and return its count; 0 where none does."""
        if not depth:
            depth = max(hits.values(), default=0)
        blocks = min(depth // hash_block_size, len(hashes))
        if blocks <= 0:
            return 0.0
        return self.observe(hashes[blocks - 1], now)


def make_prefix_reuse(halflife_s: float, core: str | None = None) -> ReuseCounts:
    """The reuse counts, compiled or not as ``holder_maps.compiled_core`` says
    (``KVFLEET_ROUTING_CORE`` by default, the variable that picks the holder maps)."""
    compiled = compiled_core("_reuse", "PrefixReuse", core)
    if compiled is None:
        return PrefixReuse(halflife_s)
    counts: ReuseCounts = compiled(halflife_s)
    return counts
