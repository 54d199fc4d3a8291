"""KV events a block pool publishes for its owner (and through it, the router's prefix index).

Every event carries the worker's sequence number (one counter shared by all of its block pools);
numbers increase by one per event, so a gap tells a consumer it missed something and must resync.
Block events name the group whose prefix cache changed and the pool that group's blocks live in
(``KVCacheGroup.pool``; hashes are per group, so ``group`` alone identifies the entry).

Tiers (docs/architecture.md, "The hybrid KV cache": the host tier). The device tier's events are
``BlockStored`` (computed, or ``BlockPromoted``: copied back from the host tier, whose copy stays),
``BlockRemoved`` (evicted from the device: offloaded or dropped, as the host events say),
``BlockPinned`` and ``BlockUnpinned``. A worker with a host tier adds, on the same log and
sequence: ``BlockOffloaded`` (the hashes entered the host tier of device pool ``pool``) and
``BlockDropped`` (they left it: its LRU reused their host block). A consumer that knows no tiers
ignores the last two and sees what it saw before. ``AllBlocksCleared`` clears both tiers. So per
worker and group, the device set is stored - removed and the host set offloaded - dropped.
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
class BlockPromoted(BlockStored):
    """Blocks of ``group`` became hittable on the device by a copy back from the host tier (which
    keeps its copy); to a consumer that knows no tiers, a ``BlockStored``."""


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
class BlockOffloaded:
    """These hashes of ``group`` entered the host tier of device pool ``pool`` (copied there when
    the device evicted them); hittable from the host tier until a ``BlockDropped``."""

    seq: int
    group: int
    block_hashes: tuple[bytes, ...]
    pool: int = 0


@dataclass(frozen=True, slots=True)
class BlockDropped:
    """These hashes of ``group`` left the host tier of device pool ``pool`` (its LRU reused their
    host block)."""

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


KVEvent = BlockStored | BlockRemoved | BlockPinned | BlockUnpinned | BlockOffloaded | BlockDropped | AllBlocksCleared
#: the events of the host tier (a consumer that tracks one tier only skips them)
HOST_TIER_EVENTS = (BlockOffloaded, BlockDropped)
