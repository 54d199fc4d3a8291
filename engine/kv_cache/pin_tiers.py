"""The pinned tiers of a ``BlockPool``: marking cached blocks pinned, unpinning, demoting.

An unreferenced block lives in the queue of its pin level (``BlockPool.tiers``): the free queue,
the retained tier or the explicit tier. These methods change pin levels and move unreferenced
blocks between those queues (in-use blocks change level only, and reach their queue on release),
announcing ``BlockPinned`` / ``BlockUnpinned`` events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.kv_cache.block_queue import PIN_EXPLICIT, PIN_NONE, Block, BlockQueue
from engine.kv_cache.events import BlockPinned, BlockUnpinned, KVEvent


class PinnedTiers:
    """The ``BlockPool`` methods that pin, unpin and demote blocks (mixin, no state of its own).

    Works on the pool's ``free_queue``, ``retained`` and ``explicit`` queues. Invariants: ``pin``
    never lowers a block's pin level and pins only cached, non-null blocks; an unreferenced block
    is linked in the queue of its pin level; after any call the retained tier holds at most
    ``retain_budget`` blocks (when set); demotion takes the oldest blocks, retained before explicit.
    """

    # The pool's state these methods work on (``BlockPool.__init__`` creates it).
    index: int
    enable_events: bool
    retain_budget: int | None
    free_queue: BlockQueue
    retained: BlockQueue
    explicit: BlockQueue
    tiers: tuple[BlockQueue, BlockQueue, BlockQueue]
    _emit: Callable[[KVEvent], None]
    _next_seq: Callable[[], int]

    # -- pinning -------------------------------------------------------------------------------
    def pin(self, blocks: Iterable[Block], level: int) -> None:
        """Mark cached blocks for the pinned tier at ``level`` (never lowers an existing pin).

        Free blocks move into the tier now; in-use blocks go there when released.
        """
        newly: list[Block] = []
        tier = self.explicit if level == PIN_EXPLICIT else self.retained
        for block in blocks:
            if block.pin >= level or block.block_hash is None or block.is_null:
                continue
            if block.ref_cnt == 0:
                self.tiers[block.pin].remove(block)
                tier.append(block)
            block.pin = level
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
                self._emit(BlockPinned(self._next_seq(), group, tuple(hashes), level == PIN_EXPLICIT, self.index))

    def unpin(self, blocks: Iterable[Block], level: int) -> None:
        """Clear pins at ``level``; free ones move to the tail of the free queue (still cached)."""
        gone: dict[int, list[bytes]] = {}
        for block in blocks:
            if block.pin != level or block.is_null:
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
            self.tiers[block.pin].remove(block)
            self.free_queue.append(block)
        block.pin = PIN_NONE
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
