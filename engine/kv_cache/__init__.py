"""Hybrid KV-cache management, pure Python (no torch, no ray).

One ``HybridCoordinator`` per worker owns one ``BlockPool`` per page size and a manager per KV-cache group (full
attention, sliding window, chunked local, Mamba). See ``coordinator.py`` for the behaviours it
guarantees and ``check_invariants`` for what tests assert after every operation; a pool's pinned
tiers (pinning, unpinning, demotion) are ``BlockPool`` methods.
"""

from engine.kv_cache.block_pool import Block, BlockPool
from engine.kv_cache.coordinator import CacheHit, HybridCoordinator, RetentionOptions
from engine.kv_cache.coordinator_types import PoolStats
from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    EventLog,
    KVEvent,
)
from engine.kv_cache.hashing import block_hashes, extend_block_hashes, hash_block
from engine.kv_cache.invariants import KVCacheInvariantError
from engine.kv_cache.request import CacheRequest
from engine.kv_cache.spec import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "AllBlocksCleared",
    "Block",
    "BlockPinned",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "BlockUnpinned",
    "CacheHit",
    "CacheRequest",
    "ChunkedLocalSpec",
    "EventLog",
    "FullAttentionSpec",
    "HybridCoordinator",
    "KVCacheGroup",
    "KVCacheInvariantError",
    "KVCacheSpec",
    "KVEvent",
    "MambaSpec",
    "PoolStats",
    "RetentionOptions",
    "SlidingWindowSpec",
    "block_hashes",
    "extend_block_hashes",
    "hash_block",
]
