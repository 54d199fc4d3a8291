"""Helpers for kv_cache tests: build coordinators and place cached blocks directly."""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_cache import CacheRequest, HybridCoordinator, KVCacheGroup, RetentionOptions
from engine.kv_cache.block_pool import Block


def coordinator(specs: Iterable, num_blocks: int = 64, **kwargs) -> HybridCoordinator:
    return HybridCoordinator([KVCacheGroup(spec) for spec in specs], num_blocks, **kwargs)


def retention(budget: int | None = None, min_drop: int = 1) -> RetentionOptions:
    return RetentionOptions(enabled=True, budget_blocks=budget, pin_sliding_window=True, min_drop_blocks=min_drop)


def request(coord: HybridCoordinator, rid: str, tokens: list[int], **kwargs) -> CacheRequest:
    return CacheRequest(rid, tokens, coord.hash_block_size, **kwargs)


def seed_cached(coord: HybridCoordinator, group: int, hashes: list[bytes], indices: Iterable[int]) -> list[Block]:
    """Register free blocks of ``group`` under ``hashes[i]`` (group granularity) for each index."""
    pool = coord.pool
    blocks = []
    for i in indices:
        block = pool.free_queue.popleft()
        pool.free_queue.append(block)  # stays free (ref 0), now cached
        block.block_hash = hashes[i]
        block.group = group
        pool.cached[group][hashes[i]] = block
        blocks.append(block)
    return blocks


def run_prefill(coord: HybridCoordinator, req: CacheRequest, num_external: int = 0) -> list[list[int]]:
    """Admit ``req`` with its local hit, compute the rest of its prompt in one step, drop
    out-of-window blocks, as a scheduler step would."""
    hit = coord.get_computed_blocks(req)
    num_new = req.num_tokens - hit.num_tokens - num_external
    ids = coord.allocate_slots(req, num_new, hit, num_external_tokens=num_external)
    assert ids is not None, "allocation unexpectedly failed"
    req.num_computed_tokens = req.num_tokens
    coord.remove_skipped_blocks(req.request_id, req.num_tokens)
    coord.check_invariants()
    return ids


def ids(blocks: list[Block]) -> list[int]:
    return [b.block_id for b in blocks]
