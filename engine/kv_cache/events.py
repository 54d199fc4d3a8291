"""KV events a block pool publishes for its owner (and through it, the router's prefix index).

Every event carries the pool's sequence number; numbers increase by one per event, so a gap
tells a consumer it missed something and must resync.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks of ``group`` became hittable under these chained hashes (in chain order)."""

    seq: int
    group: int
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These hashes of ``group`` are no longer cached (their blocks were reused or evicted)."""

    seq: int
    group: int
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class BlockPinned:
    """These cached hashes of ``group`` entered the pinned tier (explicit pin or retention)."""

    seq: int
    group: int
    block_hashes: tuple[bytes, ...]
    explicit: bool


@dataclass(frozen=True, slots=True)
class BlockUnpinned:
    """These hashes of ``group`` left the pinned tier (unpinned or demoted); still cached."""

    seq: int
    group: int
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    seq: int


KVEvent = BlockStored | BlockRemoved | BlockPinned | BlockUnpinned | AllBlocksCleared
