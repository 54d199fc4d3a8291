"""Per-type managers: one per KV-cache group, owning that group's block table per request.

Each manager answers the type's rules: which cached blocks make a hit at a given length
(``find_longest_cache_hit``), which leading blocks a request no longer needs
(``remove_skipped_blocks``), how many blocks an allocation will take, and how claimed hits and
external (transferred) tokens enter the table. Tables are append-only: a slot's block id never
changes except to the null block when the slot leaves the window.

Table index j covers tokens ``[j * block_size, (j + 1) * block_size)``.
"""

from __future__ import annotations

from operator import attrgetter

from engine.kv_cache.block_pool import PIN_RETAINED, Block, BlockPool
from engine.kv_cache.hashing import coarse_view
from engine.kv_cache.spec import ChunkedLocalSpec, FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


_REF_CNT = attrgetter("ref_cnt")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeManager:
    """Block tables of one group for every admitted request.

    Invariants: ``tables[r]`` holds, per slot, the group's block for that token range or the null
    block; ``num_cached[r]`` is the number of leading slots already registered (or deliberately
    skipped) in the prefix cache; a request is admitted here iff it has a table.
    """

    spec: KVCacheSpec
    # A hit of length L found under any bound >= L is found again, with the same blocks, under the
    # bound L (so the coordinator's fixed point need not ask again); pure lookups make it so for
    # sliding-window and Mamba groups, not for chunked local attention (its trim may drop the
    # unchecked null prefix below the chunk start).
    stable_hits = False

    def __init__(self, spec: KVCacheSpec, group: int, pool: BlockPool, hash_block_size: int):
        self.spec = spec
        self.group = group
        self.pool = pool
        self.block_size = spec.block_size
        self.hash_factor = spec.block_size // hash_block_size
        self.null = pool.null_block
        self.cached = pool.cached[group]
        self.tables: dict[str, list[Block]] = {}
        self.num_cached: dict[str, int] = {}

    # -- hashes at this group's granularity ------------------------------------------------------
    def view(self, hashes: list[bytes]) -> list[bytes]:
        return coarse_view(hashes, self.hash_factor)

    # -- hit search ------------------------------------------------------------------------------
    def find_longest_cache_hit(self, hashes: list[bytes], max_length: int, alignment: int) -> tuple[list[Block], int]:
        """Blocks (null where not needed) and length of the longest aligned hit <= max_length.

        Pure lookup: no ref count or queue changes. ``hashes`` are at this group's granularity.
        """
        raise NotImplementedError

    def hit_valid(self, hashes: list[bytes], length: int) -> bool:
        """Whether a hit of exactly ``length`` tokens is backed by cached blocks (test oracle)."""
        raise NotImplementedError

    # -- allocation --------------------------------------------------------------------------------
    def skipped_blocks(self, num_tokens: int) -> int:
        return self.spec.skipped_tokens(num_tokens) // self.block_size

    def next_skip_change(self, num_tokens: int) -> int:
        """A computed count > ``num_tokens`` at or before which ``skipped_blocks`` first grows
        (so ``remove_skipped_blocks`` drops nothing new before it)."""
        raise NotImplementedError

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit_blocks: list[Block], total_computed: int, force_external: bool
    ) -> int:
        """Blocks this group will take from the pool for an ``allocate`` with these arguments,
        counting free cached hit blocks that claiming removes from the free queue."""
        required = cdiv(num_tokens, self.block_size)
        table = self.tables.get(request_id)
        if table is not None:
            return max(required - len(table), 0)
        skipped = self.skipped_blocks(total_computed)
        base = max(skipped, len(hit_blocks))
        evictable = 0
        for block in hit_blocks[skipped:]:
            if block.ref_cnt == 0 and not block.is_null:
                evictable += 1
        return max(required - base, 0) + evictable

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks ``allocate_new`` will take for an admitted request."""
        new = -(-num_tokens // self.block_size) - len(self.tables[request_id])
        return new if new > 0 else 0

    def claim_hit(self, request_id: str, hit_blocks: list[Block], total_computed: int) -> None:
        """Phase 1: claim the local hit blocks still inside the needed range; null the rest."""
        skipped = self.skipped_blocks(total_computed)
        kept = hit_blocks[skipped:]
        if self.pool.enable_caching:
            self.pool.touch(kept)
        table = [self.null] * skipped + kept
        self.tables[request_id] = table
        self.num_cached[request_id] = len(table)

    def allocate_external(self, request_id: str, num_local: int, num_external: int) -> None:
        """Phase 2: fresh blocks for transferred tokens, only where this group needs their KV."""
        total = num_local + num_external
        skipped_tokens = self.spec.skipped_tokens(total)
        if skipped_tokens:
            num_external = min(total - skipped_tokens, num_external)
        if num_external <= 0:
            return
        table = self.tables[request_id]
        skipped = skipped_tokens // self.block_size
        if len(table) < skipped:
            table.extend([self.null] * (skipped - len(table)))
        new = cdiv(total, self.block_size) - len(table)
        if new > 0:
            table.extend(self.pool.get_new_blocks(new))

    def allocate_new(self, request_id: str, num_tokens: int) -> list[Block]:
        """Grow the table to cover ``num_tokens`` tokens; returns the new blocks."""
        table = self.tables.setdefault(request_id, [])
        self.num_cached.setdefault(request_id, 0)
        new = cdiv(num_tokens, self.block_size) - len(table)
        if new <= 0:
            return []
        blocks = self.pool.get_new_blocks(new)
        table.extend(blocks)
        return blocks

    # -- caching, window maintenance, freeing --------------------------------------------------------
    def cache_blocks(
        self, request_id: str, hashes: list[bytes], num_tokens: int, state_tokens: int | None = None
    ) -> None:
        """Register every full block up to ``num_tokens`` (hashes at this group's granularity).

        ``state_tokens`` is the request's exact computed count once the current step ran (the
        coordinator rounds ``num_tokens`` down to its alignment); only Mamba groups use it.
        """
        full = num_tokens // self.block_size
        done = self.num_cached[request_id]
        if done >= full:
            return
        self.pool.cache_blocks(self.group, self.tables[request_id], hashes, done, full)
        self.num_cached[request_id] = full

    def remove_skipped_blocks(self, request_id: str, num_computed: int) -> list[Block]:
        """Null the slots no longer needed for the next token; free them tail first. Returns the
        blocks dropped (table order reversed)."""
        table = self.tables.get(request_id)
        if table is None:
            return []
        k = min(self.skipped_blocks(num_computed), len(table))
        null = self.null
        dropped: list[Block] = []
        for j in range(k - 1, -1, -1):
            block = table[j]
            if block is null:
                break
            dropped.append(block)
            table[j] = null
        if dropped:
            self.release_dropped(request_id, dropped, k)
        return dropped

    def release_dropped(self, request_id: str, dropped: list[Block], end_index: int) -> None:
        self.pool.free_blocks(dropped)

    def free(self, request_id: str, retain: range | None = None) -> None:
        """Release the request's table, tail first; a no-op for unknown requests.

        ``retain``: table indices whose hashed blocks go to the retained tier (a hit at the
        request's shared-prefix boundary needs them) instead of the free queue.
        """
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if not table:
            return
        first = self.first_live(table) if table[0].is_null else 0
        pool = self.pool
        if retain:
            lo = max(retain.start, first)
            hi = min(retain.stop, len(table))
            if lo < hi:  # some live blocks a hit at the boundary needs
                tail, mid, head = table[hi:], table[lo:hi], table[first:lo]
                tail.reverse()
                mid.reverse()
                head.reverse()
                if tail:
                    pool.free_blocks(tail, enforce=False)
                pool.free_retaining(mid)
                if head:
                    pool.free_blocks(head, enforce=False)
                pool.enforce_retain_budget()
                return
        live = table[first:] if first else table
        live.reverse()
        pool.free_blocks(live)

    def pop_live(self, request_id: str) -> list[Block]:
        """Forget the request here and return its live blocks, last first (the order ``free``
        releases them in); empty for unknown requests. The caller releases them."""
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if not table:
            return []
        if table[0].is_null:
            table = table[self.first_live(table) :]
        table.reverse()
        return table

    def pop_release(self, request_id: str, boundary: int) -> tuple[list[Block], int, int] | None:
        """Forget the request here (as ``free`` does) and return its live blocks in release order
        (last slot first) with the positions ``[start, stop)`` in that list of the blocks a hit at
        ``boundary`` tokens needs (``start == stop``: none). None for unknown requests; the
        caller releases the blocks (``HybridCoordinator.free``)."""
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if not table:
            return None
        n = len(table)
        first = self.first_live(table) if table[0].is_null else 0
        if first:
            table = table[first:]
        table.reverse()
        window = self.blocks_needed_at(boundary)
        lo = max(window.start, first)
        hi = min(window.stop, n)
        if lo < hi:
            return table, n - hi, n - lo
        return table, 0, 0

    def first_live(self, table: list[Block]) -> int:
        """Index of the first live slot. Outside Mamba groups null slots only form a prefix of
        the table (window drops null from the front; ``check_invariants`` checks it)."""
        if not table[0].is_null:
            return 0
        i = len(table)
        while not table[i - 1].is_null:
            i -= 1
        return i

    def blocks_needed_at(self, length: int) -> range:
        """Table indices a hit at ``length`` tokens needs (for explicit prefix pins)."""
        raise NotImplementedError

    def new_step(self) -> None:
        """Called once per scheduler step."""


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
        return blocks, length

    def hit_valid(self, hashes: list[bytes], length: int) -> bool:
        return all(h in self.cached for h in hashes[: length // self.block_size])

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
            self.pool.pin(to_pin, PIN_RETAINED)
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
        return super().pop_live(request_id)

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


class MambaManager(SingleTypeManager):
    """Mamba "align" mode: one live state block at the request's end (plus the previous one until
    the next window drop); a hit at L needs the cached state block ending exactly at L.

    A state cached in this step is not yet written (states are written at the end of the
    forward), so a request whose hit relies on one waits a step.
    """

    spec: MambaSpec
    stable_hits = True

    def __init__(self, spec: MambaSpec, group: int, pool: BlockPool, hash_block_size: int):
        super().__init__(spec, group, pool, hash_block_size)
        self.cached_this_step: set[bytes] = set()
        self.live: dict[str, list[int]] = {}  # indices of real (non-null) slots, ascending

    def claim_hit(self, request_id: str, hit_blocks: list[Block], total_computed: int) -> None:
        super().claim_hit(request_id, hit_blocks, total_computed)
        table = self.tables[request_id]
        self.live[request_id] = [len(table) - 1] if table and not table[-1].is_null else []

    def _append_state(self, request_id: str, table: list[Block], needed: int) -> list[Block]:
        table.extend([self.null] * (needed - 1 - len(table)))
        blocks = self.pool.get_new_blocks(1)
        table.extend(blocks)
        self.live.setdefault(request_id, []).append(len(table) - 1)
        return blocks

    def remove_skipped_blocks(self, request_id: str, num_computed: int) -> list[Block]:
        live = self.live.get(request_id)
        if not live:
            return []
        k = self.skipped_blocks(num_computed)
        table = self.tables[request_id]
        dropped = [table[i] for i in reversed(live) if i < k]
        if dropped:
            for i in live:
                if i < k:
                    table[i] = self.null
            self.live[request_id] = [i for i in live if i >= k]
            self.pool.free_blocks(dropped)
        return dropped

    def pop_live(self, request_id: str) -> list[Block]:
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        live = self.live.pop(request_id, ())
        return [table[i] for i in reversed(live)] if table else []

    def free(self, request_id: str, retain: range | None = None) -> None:
        """Release the live state blocks (newest first); ``retain`` as for other groups."""
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        live = self.live.pop(request_id, [])
        if not table:
            return
        if retain:
            self.pool.pin([table[i] for i in retain if i < len(table)], PIN_RETAINED)
        self.pool.free_blocks([table[i] for i in reversed(live)])

    def find_longest_cache_hit(self, hashes: list[bytes], max_length: int, alignment: int) -> tuple[list[Block], int]:
        bs = self.block_size
        cached = self.cached
        for i in range(min(max_length // bs, len(hashes)) - 1, -1, -1):
            if ((i + 1) * bs) % alignment:
                continue
            block = cached.get(hashes[i])
            if block is not None:
                return [self.null] * i + [block], (i + 1) * bs
        return [], 0

    def hit_valid(self, hashes: list[bytes], length: int) -> bool:
        return length == 0 or hashes[length // self.block_size - 1] in self.cached

    def blocks_needed_at(self, length: int) -> range:
        end = length // self.block_size
        return range(end - 1, end) if end else range(0)

    def next_skip_change(self, num_tokens: int) -> int:
        # skipped_blocks(n) = (n - 1) // bs reaches k + 1 at n = (k + 1) * bs + 1
        return (self.skipped_blocks(num_tokens) + 1) * self.block_size + 1

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        return 1 if -(-num_tokens // self.block_size) > len(self.tables[request_id]) else 0

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit_blocks: list[Block], total_computed: int, force_external: bool
    ) -> int:
        required = cdiv(num_tokens, self.block_size)
        table = self.tables.get(request_id)
        if table is not None:
            return 1 if required > len(table) else 0
        if hit_blocks and hit_blocks[-1].block_hash in self.cached_this_step:
            return self.pool.num_blocks + 1  # defer: that state is written at the end of this step
        skipped = self.skipped_blocks(total_computed)
        length = max(skipped, len(hit_blocks))
        count = 0
        if force_external and total_computed > 0 and cdiv(total_computed, self.block_size) > length:
            count += 1
            length = cdiv(total_computed, self.block_size)
        if required > length:
            count += 1
        evictable = sum(1 for b in hit_blocks[skipped:] if b.ref_cnt == 0 and not b.is_null)
        return count + evictable

    def allocate_external(self, request_id: str, num_local: int, num_external: int) -> None:
        total = num_local + num_external
        table = self.tables[request_id]
        needed = cdiv(total, self.block_size)
        if total <= 0 or needed <= len(table):
            return
        self._append_state(request_id, table, needed)

    def allocate_new(self, request_id: str, num_tokens: int) -> list[Block]:
        table = self.tables.setdefault(request_id, [])
        self.num_cached.setdefault(request_id, 0)
        needed = cdiv(num_tokens, self.block_size)
        if needed <= len(table):
            return []
        return self._append_state(request_id, table, needed)

    def cache_blocks(
        self, request_id: str, hashes: list[bytes], num_tokens: int, state_tokens: int | None = None
    ) -> None:
        """Register the state after ``num_tokens`` tokens, if the request's newest state is that one.

        A Mamba block is not "full" the way an attention block is: it holds one state, the one
        after the last token its request computed into it. Only the tail state block can hold the
        state at a boundary this call has not registered yet, and only when the request's exact
        count (``state_tokens``, default ``num_tokens``) is that boundary. An older live block
        can hold a state *between* boundaries (a chunk cut short, e.g. to 1 token by the step's
        token budget, then a chunk that wrote its state into a new block): registering it under
        its block's boundary hash would hand later hits the wrong recurrent state.
        """
        full = num_tokens // self.block_size
        done = self.num_cached[request_id]
        if done >= full:
            return
        self.num_cached[request_id] = full
        if (num_tokens if state_tokens is None else state_tokens) != full * self.block_size:
            return  # the newest state is off this boundary: nothing new to register
        table = self.tables[request_id]
        tail = full - 1
        if tail >= len(table) or table[tail].is_null:
            return
        self.pool.cache_blocks(self.group, table, hashes, tail, full)
        if table[tail].block_hash == hashes[tail]:
            self.cached_this_step.add(hashes[tail])

    def new_step(self) -> None:
        self.cached_this_step.clear()


MANAGER_FOR_SPEC: dict[type, type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalSpec: ChunkedLocalManager,
    MambaSpec: MambaManager,
}
