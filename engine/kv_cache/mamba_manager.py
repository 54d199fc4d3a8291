"""The Mamba (recurrent state) manager: one live state block per request in "align" mode."""

from __future__ import annotations

from engine.kv_cache.block_pool import TIER_RETAINED, Block, BlockPool
from engine.kv_cache.manager_base import SingleTypeManager, cdiv
from engine.kv_cache.spec import MambaSpec


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

    def place(self, request_id: str, index: int, block: Block) -> None:
        super().place(request_id, index, block)
        live = self.live[request_id]
        live.append(index)
        live.sort()

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
            self.pool.retain([table[i] for i in retain if i < len(table)], TIER_RETAINED)
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
