"""The per-group manager base: one request table per admitted request, and the rules every type shares.

``SingleTypeManager`` owns one KV-cache group's block table per request; the per-type subclasses
(``attention_managers``, ``mamba_manager``) answer the type's own rules. ``managers`` maps specs
to them.

Table index j covers tokens ``[j * block_size, (j + 1) * block_size)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.kv_cache.block_pool import Block, BlockPool
from engine.kv_cache.hashing import coarse_view
from engine.kv_cache.spec import KVCacheSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeManager(ABC):
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
    @abstractmethod
    def find_longest_cache_hit(self, hashes: list[bytes], max_length: int, alignment: int) -> tuple[list[Block], int]:
        """Blocks (null where not needed) and length of the longest aligned hit <= max_length.

        Pure lookup: no ref count or queue changes. ``hashes`` are at this group's granularity.
        """
        raise NotImplementedError

    @abstractmethod
    def hit_valid(self, hashes: list[bytes], length: int) -> bool:
        """Whether a hit of exactly ``length`` tokens is backed by cached blocks (test oracle)."""
        raise NotImplementedError

    # -- allocation --------------------------------------------------------------------------------
    def skipped_blocks(self, num_tokens: int) -> int:
        return self.spec.skipped_tokens(num_tokens) // self.block_size

    @abstractmethod
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
        return max(0, new)

    def claim_hit(self, request_id: str, hit_blocks: list[Block], total_computed: int) -> None:
        """Phase 1: claim the local hit blocks still inside the needed range; null the rest."""
        skipped = self.skipped_blocks(total_computed)
        kept = hit_blocks[skipped:]
        if self.pool.enable_caching:
            self.pool.touch(kept)
        table = [self.null] * skipped + kept
        self.tables[request_id] = table
        self.num_cached[request_id] = len(table)

    def place(self, request_id: str, index: int, block: Block) -> None:
        """Put a promoted block (``HostTier.promote_hit``) at ``index`` of the request's
        table, where the claim left the null block."""
        self.tables[request_id][index] = block

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
        if retain:
            item = self._pop_split(request_id, retain)
            if item is None:
                return
            ordered, start, stop = item
            pool = self.pool
            if start == stop:
                pool.free_blocks(ordered)
                return
            if start:
                pool.free_blocks(ordered[:start], enforce=False)
            pool.free_retaining(ordered[start:stop])
            if stop < len(ordered):
                pool.free_blocks(ordered[stop:], enforce=False)
            pool.enforce_retain_budget()
            return
        table = self.tables.pop(request_id, None)  # pop_live inlined: the hot path without retention
        self.num_cached.pop(request_id, None)
        if not table:
            return
        if table[0].is_null:
            table = table[self.first_live(table) :]
        table.reverse()
        self.pool.free_blocks(table)

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
        return self._pop_split(request_id, self.blocks_needed_at(boundary))

    def _pop_split(self, request_id: str, window: range) -> tuple[list[Block], int, int] | None:
        """``pop_release`` for the table indices ``window`` (what ``free`` with ``retain`` releases)."""
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if not table:
            return None
        n = len(table)
        first = self.first_live(table) if table[0].is_null else 0
        if first:
            table = table[first:]
        table.reverse()
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

    @abstractmethod
    def blocks_needed_at(self, length: int) -> range:
        """Table indices a hit at ``length`` tokens needs (for explicit prefix pins)."""
        raise NotImplementedError

    def new_step(self) -> None:  # noqa: B027 - an optional hook: most managers keep no per-step state
        """Called once per scheduler step."""
