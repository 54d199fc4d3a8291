"""KV events a block pool publishes for its owner (and through it, the router's prefix index).

Every event carries the worker's sequence number (one counter shared by all of its block pools);
numbers increase by one per event, so a gap tells a consumer it missed something and must resync.
Block events name the group whose prefix cache changed and the pool that group's blocks live in
(``KVCacheGroup.pool``; hashes are per group, so ``group`` alone identifies the entry).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks of ``group`` became hittable under these chained hashes (in chain order)."""

    seq: int
    group: int
    block_hashes: tuple[bytes, ...]
    pool: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These hashes of ``group`` are no longer cached (their blocks were reused or evicted)."""

    seq: int
    group: int
    block_hashes: tuple[bytes, ...]
    pool: int = 0


@dataclass(frozen=True, slots=True)
class BlockPinned:
    """These cached hashes of ``group`` entered the pinned tier (explicit pin or retention)."""

    seq: int
    group: int
    block_hashes: tuple[bytes, ...]
    explicit: bool
    pool: int = 0


@dataclass(frozen=True, slots=True)
class BlockUnpinned:
    """These hashes of ``group`` left the pinned tier (unpinned or demoted); still cached."""

    seq: int
    group: int
    block_hashes: tuple[bytes, ...]
    pool: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    seq: int


class EventLog:
    """The event list and sequence counter shared by the block pools of one worker.

    Invariant: ``seq`` is the number of the last event numbered (events are numbered even when
    ``enabled`` is False for ``AllBlocksCleared``, as before; block events are only built when
    enabled); ``take()`` drains in sequence order.
    """

    __slots__ = ("enabled", "events", "seq")

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.events: list[KVEvent] = []
        self.seq = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def emit(self, event: KVEvent) -> None:
        if self.enabled:
            self.events.append(event)

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


KVEvent = BlockStored | BlockRemoved | BlockPinned | BlockUnpinned | AllBlocksCleared
