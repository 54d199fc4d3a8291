"""Attention managers: full attention, sliding window (with its retention anchors), chunked local.

Each subclass of ``SingleTypeManager`` states which cached blocks a hit at a given length needs
and which leading blocks a request no longer needs.
"""

from __future__ import annotations

from operator import attrgetter

from engine.kv_cache.block_pool import TIER_RETAINED, Block, BlockPool
from engine.kv_cache.manager_base import SingleTypeManager, cdiv
from engine.kv_cache.spec import ChunkedLocalSpec, SlidingWindowSpec

_REF_CNT = attrgetter("ref_cnt")


NEVER_SKIPS = 1 << 62  # a token count no request reaches


class FullAttentionManager(SingleTypeManager):
    """Full attention: a hit needs every block of the prefix; hits are downward closed."""

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit_blocks: list[Block], total_computed: int, force_external: bool
    ) -> int:
        table = self.tables.get(request_id)
        if table is not None:
            return max(cdiv(num_tokens, self.block_size) - len(table), 0)
        # Nothing is skipped and a full-attention hit holds no null block: every free hit block
        # (ref 0) leaves the free queue when claimed.
        evictable = list(map(_REF_CNT, hit_blocks)).count(0) if hit_blocks else 0
        return max(cdiv(num_tokens, self.block_size) - len(hit_blocks), 0) + evictable

    def find_longest_cache_hit(self, hashes: list[bytes], max_length: int, alignment: int) -> tuple[list[Block], int]:
        blocks = list(map(self.cached.get, hashes[: max_length // self.block_size]))
        if None in blocks:  # the hit ends at the first miss
            del blocks[blocks.index(None) :]
        length = len(blocks) * self.block_size
        if alignment != self.block_size:
            length -= length % alignment
            del blocks[cdiv(length, self.block_size) :]
        return blocks, length  # type: ignore[return-value]  # no None is left: the hit ends before the first miss

    def hit_valid(self, hashes: list[bytes], length: int) -> bool:
        return all(h in self.cached for h in hashes[: length // self.block_size])

    def next_skip_change(self, num_tokens: int) -> int:
        """Full attention never skips a leading block (the coordinator asks only groups that do)."""
        return NEVER_SKIPS

    def blocks_needed_at(self, length: int) -> range:
        return range(length // self.block_size)

    def pop_release(self, request_id: str, boundary: int) -> tuple[list[Block], int, int] | None:
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if not table:
            return None
        if table[0].is_null:  # never for full attention (nothing is skipped); kept general
            self.tables[request_id] = table
            self.num_cached[request_id] = 0
            return super().pop_release(request_id, boundary)
        n = len(table)
        table.reverse()
        needed = boundary // self.block_size  # a hit needs every block before it
        return table, (n - needed if needed < n else 0), n


class SlidingWindowManager(SingleTypeManager):
    """Sliding window: a hit at L needs the ``blocks_for_hit`` blocks ending at L (or, near the
    start, every block from 0). Not downward closed: searched right to left.

    With retention on, window drops pin the window ending at each of the request's useful
    boundaries (chunk ends, shared-prefix boundary) when the drop frees at least
    ``min_drop_blocks`` blocks; other dropped blocks go to the head of the free queue.
    """

    spec: SlidingWindowSpec
    stable_hits = True

    def __init__(
        self,
        spec: SlidingWindowSpec,
        group: int,
        pool: BlockPool,
        hash_block_size: int,
        retain: bool = False,
        min_drop_blocks: int = 1,
    ):
        super().__init__(spec, group, pool, hash_block_size)
        self.need = spec.blocks_for_hit
        self.retain = retain
        self.min_drop_blocks = min_drop_blocks
        self.boundaries: dict[str, set[int]] = {}

    def find_longest_cache_hit(self, hashes: list[bytes], max_length: int, alignment: int) -> tuple[list[Block], int]:
        bs = self.block_size
        cached = self.cached
        need = self.need
        num = min(max_length // bs, len(hashes))
        null = self.null
        run = 0
        check_align = bs != alignment
        i = num - 1
        while i >= 0:
            block = cached.get(hashes[i])
            if block is None:
                run = 0
            elif run == 0 and check_align and ((i + 1) * bs) % alignment:
                pass  # a run must end on an aligned boundary
            else:
                run += 1
                if run >= need:
                    end = i + run
                    out = [null] * i
                    out += map(cached.__getitem__, hashes[i:end])
                    return out, end * bs
            i -= 1
        # No full window: a run touching block 0 is a hit (there is no earlier context).
        out = [cached[h] for h in hashes[:run]]
        while out and (len(out) * bs) % alignment:
            out.pop()
        return out, len(out) * bs

    def hit_valid(self, hashes: list[bytes], length: int) -> bool:
        end = length // self.block_size
        return all(h in self.cached for h in hashes[max(0, end - self.need) : end])

    def blocks_needed_at(self, length: int) -> range:
        end = length // self.block_size
        return range(max(0, end - self.need), end)

    def next_skip_change(self, num_tokens: int) -> int:
        # skipped_blocks(n) = (n - window + 1) // bs reaches k + 1 at n = (k + 1) * bs + window - 1
        return (self.skipped_blocks(num_tokens) + 1) * self.block_size + self.spec.window - 1

    # -- retention -----------------------------------------------------------------------------------
    def add_boundary(self, request_id: str, num_tokens: int) -> None:
        """Remember a token count at which this request's window is worth pinning when dropped."""
        if self.retain and num_tokens >= self.block_size:
            self.boundaries.setdefault(request_id, set()).add(num_tokens - num_tokens % self.block_size)

    def release_dropped(self, request_id: str, dropped: list[Block], end_index: int) -> None:
        """Release blocks that left the window (``dropped`` holds table indices ``end_index - 1``
        down to ``end_index - len(dropped)``).

        With retention: the blocks of a boundary's window (the blocks a hit at that boundary
        needs) are pinned when the drop releasing them frees at least ``min_drop_blocks`` blocks,
        and freed as ordinary cached blocks by smaller drops; every other dropped block is freed
        evict-first, since no hit can use it without the blocks after it.
        """
        boundaries = self.boundaries.get(request_id) if self.retain else None
        if not self.retain:
            self.pool.free_blocks(dropped)
            return
        first_index = end_index - len(dropped)
        to_pin: list[Block] = []
        keep: set[int] = set()
        if boundaries:
            for boundary in sorted(boundaries):
                window = self.blocks_needed_at(boundary)
                if window.start >= end_index:
                    break  # still entirely in the window
                if window.stop <= end_index:
                    boundaries.discard(boundary)  # no part of it stays live after this drop
                lo, hi = max(window.start, first_index), min(window.stop, end_index)
                if lo >= hi:
                    continue
                if len(dropped) >= self.min_drop_blocks:
                    to_pin.extend(dropped[end_index - 1 - j] for j in range(lo, hi))
                else:
                    keep.update(range(lo, hi))
        if to_pin:
            self.pool.retain(to_pin, TIER_RETAINED)
        if keep:
            kept = [b for m, b in enumerate(dropped) if end_index - 1 - m in keep]
            rest = [b for m, b in enumerate(dropped) if end_index - 1 - m not in keep]
            self.pool.free_blocks(kept)
            self.pool.free_blocks(rest, evict_first=True)
        else:
            self.pool.free_blocks(dropped, evict_first=True)

    def free(self, request_id: str, retain: range | None = None) -> None:
        self.boundaries.pop(request_id, None)
        super().free(request_id, retain)

    def pop_live(self, request_id: str) -> list[Block]:
        self.boundaries.pop(request_id, None)
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if not table:
            return []
        if table[0].is_null:  # nulls form a prefix: the live blocks are the last ones
            first = len(table)
            while not table[first - 1].is_null:
                first -= 1
            return table[: first - 1 : -1]
        table.reverse()
        return table

    def pop_release(self, request_id: str, boundary: int) -> tuple[list[Block], int, int] | None:
        self.boundaries.pop(request_id, None)
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if not table:
            return None
        n = len(table)
        if table[0].is_null:  # nulls form a prefix: the live blocks are the last ones
            first = n
            while not table[first - 1].is_null:
                first -= 1
            table = table[: first - 1 : -1]  # the live blocks, last first
        else:
            first = 0
            table.reverse()
        end = boundary // self.block_size
        if end > first:  # the boundary's window may still be live (mostly it left long ago)
            lo = max(end - self.need, first)
            hi = min(end, n)
            if lo < hi:
                return table, n - hi, n - lo
        return table, 0, 0


class ChunkedLocalManager(SingleTypeManager):
    """Chunked local attention: a hit at L needs the blocks of L's chunk before L; whole earlier
    chunks count as computed without lookup."""

    spec: ChunkedLocalSpec

    def find_longest_cache_hit(self, hashes: list[bytes], max_length: int, alignment: int) -> tuple[list[Block], int]:
        bs = self.block_size
        chunk = self.spec.chunk_size
        start = (max_length // chunk) * chunk // bs if max_length > 0 else 0
        out: list[Block] = [self.null] * start
        cached = self.cached
        for i in range(start, min(max_length // bs, len(hashes))):
            block = cached.get(hashes[i])
            if block is None:
                break
            out.append(block)
        while out and (len(out) * bs) % alignment:
            out.pop()
        return out, len(out) * bs

    def hit_valid(self, hashes: list[bytes], length: int) -> bool:
        return all(h in self.cached for h in hashes[self._chunk_start_block(length) : length // self.block_size])

    def _chunk_start_block(self, length: int) -> int:
        chunk = self.spec.chunk_size
        # A hit ending exactly on a chunk boundary needs nothing; otherwise the current chunk.
        return ((length // chunk) * chunk) // self.block_size

    def blocks_needed_at(self, length: int) -> range:
        return range(self._chunk_start_block(length), length // self.block_size)

    def next_skip_change(self, num_tokens: int) -> int:
        chunk = self.spec.chunk_size
        return (num_tokens // chunk + 1) * chunk  # skipped tokens only change on chunk boundaries
