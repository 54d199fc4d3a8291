"""One block pool: the blocks of one page size, shared by the KV-cache groups drawing from it.

A worker has one pool per page size (``KVCacheGroup.pool``); each pool numbers its blocks 0..n-1,
block 0 being its own null block. Owns: all blocks of the pool, the free queue (head = reused
first), two pinned tiers (retained anchors, then explicit pins; oldest first), one hash -> block map
per group, the null block, and the KV event log. Invariants (checked by
``HybridCoordinator.check_invariants``): a non-null block is linked in exactly one queue iff its ref
count is 0; free + pinned + in-use == num_blocks - 1; every map entry points at a block carrying
that hash and group. Only the maps of groups in this pool are ever filled. Events go to the worker's
``EventLog`` (shared by its pools: one sequence).

An unreferenced block lives in the queue of its tier (``Block.tier``) (``BlockPool.tiers``): the free queue, the
retained tier or the explicit tier (docs/architecture.md, "The hybrid KV cache": the retention
tier). ``retain``, ``release_tier``, ``demote`` and ``enforce_retain_budget`` change tiers and move
unreferenced blocks between those queues (in-use blocks change level only and reach their queue on
release), announcing ``BlockPinned`` / ``BlockUnpinned`` events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.kv_cache.block_queue import TIER_EXPLICIT, TIER_NONE, TIER_RETAINED, Block, BlockQueue
from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockPinned,
    BlockPromoted,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    EventLog,
    KVEvent,
)


class BlockPool:
    """Blocks, ref counts, free/pinned queues, per-group prefix-cache maps and KV events of one pool.

    ``index`` is the pool's number (stamped on its blocks and events). ``retain_budget`` caps this
    pool's retained tier (None: no cap); entering it beyond the cap demotes its
    oldest blocks. Allocation never fails while free + pinned blocks suffice: pinned blocks are
    demoted (oldest retained first, then oldest explicit) to make room.

    Tier invariants: ``retain`` never lowers a block's tier and retains only cached, non-null
    blocks; an unreferenced block is linked in the queue of its tier; after any public call
    the retained tier holds at most ``retain_budget`` blocks (when set; ``free_blocks(...,
    enforce=False)`` and ``free_retaining`` leave that to the caller); demotion takes the oldest
    blocks, retained before explicit.
    """

    def __init__(
        self,
        num_blocks: int,
        num_groups: int,
        enable_caching: bool = True,
        retain_budget: int | None = None,
        enable_events: bool = False,
        index: int = 0,
        events: EventLog | None = None,
    ):
        if num_blocks < 2:
            raise ValueError(f"num_blocks: must be >= 2 (got {num_blocks})")
        self.index = index
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.retain_budget = retain_budget
        self.log = events if events is not None else EventLog(enable_events)
        self.enable_events = self.log.enabled
        self.blocks = [Block(i, index) for i in range(num_blocks)]
        self.free_queue = BlockQueue("free", self.blocks)
        self.retained = BlockQueue("retained")
        self.explicit = BlockQueue("explicit")
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        # The queue an unreferenced block is linked in: the one of its tier.
        self.tiers: tuple[BlockQueue, BlockQueue, BlockQueue] = (self.free_queue, self.retained, self.explicit)
        self.cached: list[dict[bytes, Block]] = [{} for _ in range(num_groups)]
        # called with (block id, group, hash) for each cached block ``get_new_blocks`` evicts (the
        # host tier's offload, ``engine.kv_cache.host_tier``); None: evicted contents are dropped
        self.offload: Callable[[int, int, bytes], None] | None = None

    # -- capacity ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free plus pinned (pinned ones are demoted on demand)."""
        return self.free_queue.size + self.retained.size + self.explicit.size

    @property
    def num_retained_blocks(self) -> int:
        return self.retained.size + self.explicit.size

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    # -- allocation ----------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[Block]:
        """Take ``n`` exclusively owned, hash-free blocks (ref 1), evicting cached ones as needed."""
        if n <= 0:
            return []
        short = n - self.free_queue.size
        if short > 0:
            if short > self.retained.size + self.explicit.size:
                raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
            self.demote(short)
        queue = self.free_queue
        cached = self.cached
        removed: list[tuple[int, bytes]] | None = [] if self.enable_events else None
        offload = self.offload
        blocks = []
        block: Block = queue.head.next  # type: ignore[assignment]  # n <= free size: a real block
        for _ in range(n):  # unlink the first n blocks, uncache them, count the new reference
            blocks.append(block)
            nxt = block.next
            block.prev = block.next = None
            block.ref_cnt = 1
            if block.block_hash is not None:  # evict it from the prefix cache (``group`` means nothing once unhashed)
                if removed is not None:
                    removed.append((block.group, block.block_hash))
                if offload is not None:
                    offload(block.block_id, block.group, block.block_hash)
                del cached[block.group][block.block_hash]
                block.block_hash = None
            block = nxt  # type: ignore[assignment]  # linked, so the next block is set (the tail sentinel at worst)
        queue.head.next = block
        block.prev = queue.head
        queue.size -= n
        if removed:
            self._emit_removed(removed)
        return blocks

    def _emit_removed(self, removed: list[tuple[int, bytes]]) -> None:
        """One ``BlockRemoved`` per group for these (group, hash) entries, in order."""
        by_group: dict[int, list[bytes]] = {}
        for group, block_hash in removed:
            by_group.setdefault(group, []).append(block_hash)
        for group, hashes in by_group.items():
            self._emit(BlockRemoved(self._next_seq(), group, tuple(hashes), self.index))

    def touch(self, blocks: Iterable[Block]) -> None:
        """Claim blocks found by a prefix hit: unlink free/pinned ones, then count the reference.
        Null blocks are skipped (the null block is never counted: its ``ref_cnt`` stays 0)."""
        tiers = self.tiers
        from_free = 0
        for block in blocks:
            if block.ref_cnt:
                block.ref_cnt += 1
                continue
            prev = block.prev
            if prev is None:  # the null block
                continue
            nxt = block.next
            prev.next = nxt
            nxt.prev = prev  # type: ignore[union-attr]  # linked, so both neighbours are set
            block.prev = block.next = None
            block.ref_cnt = 1
            if block.tier:
                tiers[block.tier].size -= 1
            else:
                from_free += 1
        self.free_queue.size -= from_free

    def free_blocks(self, ordered: list[Block], evict_first: bool = False, enforce: bool = True) -> None:
        """Drop one reference from each block; ``ordered`` lists blocks evict-first first and holds
        no null block (callers pass live table slots only).

        Released blocks go to their pinned tier if pinned; otherwise uncached ones (and every one
        when ``evict_first``) to the head of the free queue, cached ones to its tail (linked there
        in the same pass). ``enforce=False`` leaves the retained tier's budget to the caller.
        """
        front: list[Block] = []
        pinned: list[Block] = []
        if evict_first:
            for block in ordered:
                block.ref_cnt -= 1
                if not block.ref_cnt:
                    (pinned if block.tier else front).append(block)
        else:
            queue = self.free_queue
            tail = queue.tail
            last: Block = tail.prev  # type: ignore[assignment]  # the head sentinel at worst
            held = 0  # blocks still referenced (the rest are released: linked here or listed)
            for block in ordered:
                if block.ref_cnt != 1:  # still held by another table
                    block.ref_cnt -= 1
                    held += 1
                    continue
                block.ref_cnt = 0
                if block.tier:
                    pinned.append(block)
                elif block.block_hash is None:  # uncached (``is None``: the digest itself stays unread)
                    front.append(block)
                else:
                    block.prev = last
                    last.next = block
                    last = block
            last.next = tail
            tail.prev = last
            queue.size += len(ordered) - held - len(front) - len(pinned)
        if front:
            self.free_queue.prepend_n(front)
        if pinned:
            self._to_tiers(pinned, enforce)

    def free_retaining(self, ordered: list[Block]) -> None:
        """``free_blocks`` (budget left to the caller) of blocks a hit needs, first marking the
        hashed ones for the retained tier (as ``retain(ordered, TIER_RETAINED)`` would), in one pass."""
        tier = self.retained
        tail = tier.tail
        last: Block = tail.prev  # type: ignore[assignment]  # the head sentinel at worst
        held = 0
        newly: list[Block] | None = [] if self.enable_events else None
        front: list[Block] = []
        explicit: list[Block] = []
        for block in ordered:
            if block.ref_cnt != 1:  # still held by another table
                block.ref_cnt -= 1
                if not block.tier and block.block_hash is not None:
                    block.tier = TIER_RETAINED  # goes to the tier when its last holder releases it
                    if newly is not None:
                        newly.append(block)
                held += 1
                continue
            block.ref_cnt = 0
            if block.tier == TIER_RETAINED:
                pass
            elif block.tier:
                explicit.append(block)
                continue
            elif block.block_hash is None:
                front.append(block)
                continue
            else:
                block.tier = TIER_RETAINED
                if newly is not None:
                    newly.append(block)
            block.prev = last
            last.next = block
            last = block
        last.next = tail
        tail.prev = last
        tier.size += len(ordered) - held - len(front) - len(explicit)
        if newly:
            newly.reverse()  # table order, as retain() announces them
            self._emit_pinned(newly, TIER_RETAINED)
        if front:
            self.free_queue.prepend_n(front)
        if explicit:
            self._to_tiers(explicit, False)

    def _to_tiers(self, blocks: list[Block], enforce: bool) -> None:
        """Released pinned blocks to their tier, in order."""
        explicit, retained = self.explicit, self.retained
        for block in blocks:
            (explicit if block.tier == TIER_EXPLICIT else retained).append(block)
        if enforce:
            self.enforce_retain_budget()

    # -- pinning -------------------------------------------------------------------------------
    def retain(self, blocks: Iterable[Block], level: int) -> None:
        """Mark cached blocks for the pinned tier at ``level`` (never lowers an existing pin).

        Free blocks move into the tier now; in-use blocks go there when released.
        """
        newly: list[Block] = []
        tier = self.explicit if level == TIER_EXPLICIT else self.retained
        for block in blocks:
            if block.tier >= level or block.block_hash is None or block.is_null:
                continue
            if block.ref_cnt == 0:
                self.tiers[block.tier].remove(block)
                tier.append(block)
            block.tier = level
            newly.append(block)
        if newly:
            self._emit_pinned(newly, level)
            self.enforce_retain_budget()

    def _emit_pinned(self, blocks: list[Block], level: int) -> None:
        if self.enable_events:
            by_group: dict[int, list[bytes]] = {}
            for block in blocks:
                if block.block_hash is not None:  # always: only cached blocks are pinned
                    by_group.setdefault(block.group, []).append(block.block_hash)
            for group, hashes in by_group.items():
                self._emit(BlockPinned(self._next_seq(), group, tuple(hashes), level == TIER_EXPLICIT, self.index))

    def release_tier(self, blocks: Iterable[Block], level: int) -> None:
        """Clear pins at ``level``; free ones move to the tail of the free queue (still cached)."""
        gone: dict[int, list[bytes]] = {}
        for block in blocks:
            if block.tier != level or block.is_null:
                continue
            self._clear_pin(block, gone)
        self._emit_unpinned(gone)

    def demote(self, n: int) -> int:
        """Move up to ``n`` of the oldest pinned free blocks (retained first) to the free queue."""
        gone: dict[int, list[bytes]] = {}
        done = 0
        for queue in (self.retained, self.explicit):
            while done < n and queue.size:
                self._clear_pin(queue.head.next, gone)  # type: ignore[arg-type]  # size > 0: a real block
                done += 1
        self._emit_unpinned(gone)
        return done

    def _clear_pin(self, block: Block, gone: dict[int, list[bytes]]) -> None:
        if block.ref_cnt == 0:
            self.tiers[block.tier].remove(block)
            self.free_queue.append(block)
        block.tier = TIER_NONE
        if block.block_hash is not None:
            gone.setdefault(block.group, []).append(block.block_hash)

    def enforce_retain_budget(self) -> None:
        """Demote the oldest retained blocks beyond ``retain_budget`` to the free queue's tail."""
        if self.retain_budget is None:
            return
        over = self.retained.size - self.retain_budget
        if over <= 0:
            return
        gone: dict[int, list[bytes]] = {}
        for _ in range(over):
            self._clear_pin(self.retained.head.next, gone)  # type: ignore[arg-type]  # over > 0: a real block
        self._emit_unpinned(gone)

    def _emit_unpinned(self, gone: dict[int, list[bytes]]) -> None:
        if self.enable_events:
            for group, hashes in gone.items():
                self._emit(BlockUnpinned(self._next_seq(), group, tuple(hashes), self.index))

    # -- prefix cache ----------------------------------------------------------------------------
    def cache_blocks(
        self, group: int, blocks: list[Block], hashes: list[bytes], start: int, end: int, promoted: bool = False
    ) -> None:
        """Register ``blocks[start:end]`` of a request's table under ``hashes[start:end]``
        (``promoted``: their contents come from the host tier, announced as ``BlockPromoted``).

        Null blocks and blocks already cached (prefix hits) are skipped. The map holds one block
        per hash: when the same content was recomputed into a new block, the new block takes over
        the entry if the old one is free and unpinned (the fresher copy is kept, the stale one goes
        to the head of the free queue); otherwise the new block stays uncached.
        """
        table = self.cached[group]
        stored: list[bytes] | None = [] if self.enable_events else None
        for block, block_hash in zip(blocks[start:end], hashes[start:end], strict=False):
            if block.block_hash or block.is_null:
                continue
            if block_hash in table:
                old = table[block_hash]
                if old.ref_cnt or old.tier:
                    continue
                old.block_hash = None
                old.group = -1
                self.free_queue.remove(old)
                self.free_queue.prepend_n([old])
            if stored is not None:
                stored.append(block_hash)
            block.block_hash = block_hash
            block.group = group
            table[block_hash] = block
        if stored:
            self._emit((BlockPromoted if promoted else BlockStored)(self._next_seq(), group, tuple(stored), self.index))

    def _uncache(self, block: Block, block_hash: bytes, removed: dict[int, list[bytes]] | None) -> None:
        del self.cached[block.group][block_hash]
        if removed is not None:
            removed.setdefault(block.group, []).append(block_hash)
        block.block_hash = None
        block.group = -1

    def evict(self, blocks: Iterable[Block]) -> None:
        """Drop the cache entries of these blocks (e.g. a failed transfer wrote them)."""
        removed: dict[int, list[bytes]] | None = {} if self.enable_events else None
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None and not block.is_null:
                self._uncache(block, block_hash, removed)
        if removed:
            for group, hashes in removed.items():
                self._emit(BlockRemoved(self._next_seq(), group, tuple(hashes), self.index))

    @property
    def idle(self) -> bool:
        """No block of this pool is in use."""
        return self.num_free_blocks == self.num_blocks - 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if not self.idle:
            return False
        self.clear_prefix_cache()
        self._emit(AllBlocksCleared(self._next_seq()))
        return True

    def clear_prefix_cache(self) -> None:
        """Forget every cached hash and pin of an idle pool (no event: the caller emits one)."""
        for queue in (self.retained, self.explicit):
            blocks = queue.popleft_n(queue.size)
            for block in blocks:
                block.tier = TIER_NONE
            self.free_queue.append_n(blocks)
        for table in self.cached:
            for block in table.values():
                block.block_hash = None
                block.group = -1
            table.clear()

    # -- events --------------------------------------------------------------------------------
    def _next_seq(self) -> int:
        return self.log.next_seq()

    def _emit(self, event: KVEvent) -> None:
        self.log.emit(event)

    def take_events(self) -> list[KVEvent]:
        """Drain the events published since the last call (in sequence order; with a shared log,
        every pool's events)."""
        return self.log.take()

    # -- read-only views for the router ----------------------------------------------------------
    @property
    def event_seq(self) -> int:
        """Sequence number of the last KV event of the pool's log (0 before the first)."""
        return self.log.seq

    def snapshot(self) -> tuple[int, tuple[dict[bytes, int], ...]]:
        """``(event_seq, per-group {hash: pin level})``: every cached hash as of ``event_seq``
        (events with a larger number are not reflected). The dicts are fresh copies."""
        return self.log.seq, tuple({h: block.tier for h, block in table.items()} for table in self.cached)


__all__ = ["TIER_EXPLICIT", "TIER_NONE", "TIER_RETAINED", "Block", "BlockPool", "BlockQueue"]
