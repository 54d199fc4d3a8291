"""The block data model: what token prefix every physical block holds (with Mamba states pending
until the forward ends), written by computations and loads (``compute``, ``load``) and checked on
every read and after every operation (``check_cached``); cached (sealed) blocks must never be
overwritten.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_cache import CacheRequest
from engine.kv_cache.attention_managers import ChunkedLocalManager, SlidingWindowManager
from engine.kv_cache.block_pool import Block
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.manager_base import SingleTypeManager
from kvfleet_testing.kv_cache_sim.log import SimLog
from kvfleet_testing.kv_cache_sim.records import SimRequest, cdiv

BlockKey = tuple[int, int]  # (pool, block id)
# What a block holds: (group, first valid position, end, prefix key of the request through end)
Content = tuple[int, int, int, tuple | None]


def block_key(block: Block) -> BlockKey:
    """A block's identity across pools: (pool, block id)."""
    return block.pool, block.block_id


class DataModel:
    """Owns what every written block holds (``_content``: block -> ``Content``), the Mamba states
    written in the current step (``_pending``: block -> (request id, content), landing at the end of
    the forward), the blocks handed out since the last check (``_fresh``) and those that carried a
    hash before the current operation's allocation (``_hashed_before``). Invariants checked: a read
    finds the request's own prefix in non-null blocks; a write never changes a block cached before
    this operation's allocation and not handed out since; a Mamba state is readable only after the
    step that wrote it; every cached block holds exactly the prefix its hash names. With
    ``enabled`` false, computations and loads record nothing and ``check_cached`` checks nothing."""

    def __init__(self, managers: list[SingleTypeManager], log: SimLog, enabled: bool) -> None:
        self._enabled = enabled
        self._managers = managers
        self._log = log
        self._content: dict[BlockKey, Content] = {}
        self._pending: dict[BlockKey, tuple[str, Content]] = {}
        self._fresh: set[BlockKey] = set()
        self._hashed_before: set[BlockKey] = set()

    # -- allocation marks ----------------------------------------------------------------------------------
    def record_fresh(self, blocks: Iterable[Block]) -> None:
        """``blocks`` were just handed out by a pool's ``get_new_blocks``: writable again."""
        self._fresh.update(block_key(b) for b in blocks)

    def begin_allocation(self, hashed: set[BlockKey]) -> None:
        """An ``allocate_slots`` call follows; ``hashed`` are the blocks carrying a hash before it."""
        self._hashed_before = hashed

    def end_operation(self) -> None:
        """The operation is over (its check begins): forget the allocation marks."""
        self._fresh.clear()
        self._hashed_before = set()

    def _prefix_key(self, req: CacheRequest, n: int) -> tuple | None:
        """Identity of ``req.token_ids[:n]`` (None if the request has fewer tokens)."""
        if n > req.num_tokens or n < 0:
            return None
        hbs = req.hash_block_size
        full = n // hbs
        if full and full * hbs == n:
            return ("H", req.block_hashes[full - 1])
        parent = req.block_hashes[full - 1] if full else None
        return ("P", req.cache_salt, parent, tuple(req.token_ids[full * hbs : n]))

    # -- data model --------------------------------------------------------------------------------------
    def _read(self, req: CacheRequest, g: int, table: list, j: int, lo: int, hi: int, what: str) -> None:
        """Positions [lo, hi) of table index j must hold ``req``'s own KV."""
        bs = self._managers[g].block_size
        if j >= len(table) or table[j].is_null:
            self._log.fail(
                f"{what}: {req.request_id} group {g} reads positions {lo}..{hi} but index {j} is null/missing"
            )
        bid = table[j].block_id
        content = self._content.get(block_key(table[j]))
        if content is None:
            self._log.fail(f"{what}: {req.request_id} group {g} reads block {bid} (index {j}) that was never written")
        group, first, end, key = content
        if (
            group != g
            or not (j * bs < end <= (j + 1) * bs)
            or first > lo
            or end < hi
            or self._prefix_key(req, end) != key
        ):
            self._log.fail(
                f"{what}: {req.request_id} group {g} index {j} block {bid} holds positions [{first}, {end}) of "
                f"another prefix / range, needs [{lo}, {hi}) of its own"
            )

    def _write(self, req: CacheRequest, g: int, table: list, j: int, lo: int, hi: int, what: str) -> None:
        bs = self._managers[g].block_size
        if j >= len(table) or table[j].is_null:
            self._log.fail(
                f"{what}: {req.request_id} group {g} writes positions {lo}..{hi} but index {j} is null/missing"
            )
        block = table[j]
        old = self._content.get(block_key(block))
        first = lo
        end = hi
        if old is not None:
            o_group, o_first, o_end, o_key = old
            if (
                o_group == g
                and j * bs < o_end <= (j + 1) * bs
                and o_first <= lo <= o_end
                and self._prefix_key(req, o_end) == o_key
            ):
                first = o_first
                end = max(o_end, hi)
        new = (g, first, end, self._prefix_key(req, end))
        if new != old and self._sealed(block):
            self._log.fail(f"{what}: {req.request_id} group {g} writes into cached block {block!r} at index {j}")
        self._content[block_key(block)] = new

    def effective(self, bid: BlockKey) -> Content | None:
        """Contents once the current step's forward has finished (pending Mamba states included)."""
        pending = self._pending.get(bid)
        return pending[1] if pending is not None else self._content.get(bid)

    def commit(self, rid: str | None = None) -> None:
        """The forward finished (for ``rid``, or for everyone): pending Mamba states land."""
        for bid, (owner, content) in list(self._pending.items()):
            if rid is None or owner == rid:
                self._content[bid] = content
                del self._pending[bid]

    def _write_state(
        self, req: CacheRequest, g: int, table: list, length: int, what: str, deferred: bool = True
    ) -> None:
        bs = self._managers[g].block_size
        j = cdiv(length, bs) - 1
        if j >= len(table) or table[j].is_null:
            self._log.fail(
                f"{what}: {req.request_id} Mamba group {g} has no state block at index {j} for {length} tokens"
            )
        block = table[j]
        key = block_key(block)
        new = (g, length, length, self._prefix_key(req, length))
        if self.effective(key) != new and self._sealed(block):
            self._log.fail(f"{what}: {req.request_id} Mamba group {g} overwrites cached state block {block!r}")
        if deferred:
            self._pending[key] = (req.request_id, new)
        else:
            self._pending.pop(key, None)
            self._content[key] = new

    def _sealed(self, block: Block) -> bool:
        """A block whose contents must not change: cached before this operation's allocation and not
        handed out again since (eager caching hashes blocks just before their KV is written)."""
        key = block_key(block)
        return block.block_hash is not None and key in self._hashed_before and key not in self._fresh

    def _read_state(self, req: CacheRequest, g: int, table: list, length: int, what: str) -> None:
        bs = self._managers[g].block_size
        j = cdiv(length, bs) - 1
        if j >= len(table) or table[j].is_null:
            self._log.fail(f"{what}: {req.request_id} Mamba group {g} lost the state after {length} tokens (index {j})")
        bid = table[j].block_id
        if block_key(table[j]) in self._pending:
            self._log.fail(
                f"{what}: {req.request_id} Mamba group {g} reads block {bid}, "
                "whose state is written only at the end of this step"
            )
        content = self._content.get(block_key(table[j]))
        if content is None or content[:3] != (g, length, length) or content[3] != self._prefix_key(req, length):
            self._log.fail(
                f"{what}: {req.request_id} Mamba group {g} index {j} block {table[j].block_id} holds state "
                f"{content[:3] if content else None}, needs the state after its own {length} tokens"
            )

    def compute(self, r: SimRequest, start: int, end: int, what: str) -> None:
        """The forward pass of tokens [start, end): read what they attend to, write their KV/state."""
        if not self._enabled:
            return
        req = r.req
        rid = r.rid
        for g, m in enumerate(self._managers):
            table = m.tables[rid]
            bs = m.block_size
            if isinstance(m, MambaManager):
                if start:
                    self._read_state(req, g, table, start, what)
                self._write_state(req, g, table, end, what)
                continue
            if isinstance(m, SlidingWindowManager):
                lo = max(0, start - m.spec.window + 1)
            elif isinstance(m, ChunkedLocalManager):
                lo = (start // m.spec.chunk_size) * m.spec.chunk_size
            else:
                lo = 0
            for j in range(lo // bs, cdiv(start, bs)):
                self._read(req, g, table, j, max(lo, j * bs), min(start, (j + 1) * bs), what)
            for j in range(start // bs, cdiv(end, bs)):
                self._write(req, g, table, j, max(start, j * bs), min(end, (j + 1) * bs), what)

    def load(self, r: SimRequest, start: int, end: int, what: str) -> None:
        """External KV for tokens [start, end) lands (only where the table has real blocks); Mamba
        groups receive the state after ``end`` tokens."""
        if not self._enabled:
            return
        req = r.req
        for g, m in enumerate(self._managers):
            table = m.tables[r.rid]
            if isinstance(m, MambaManager):
                if end > 0:
                    self._write_state(req, g, table, end, what, deferred=False)
                continue
            bs = m.block_size
            for j in range(start // bs, cdiv(end, bs)):
                if j < len(table) and not table[j].is_null:
                    self._write(req, g, table, j, max(start, j * bs), min(end, (j + 1) * bs), what)

    def check_cached(self) -> None:
        """Every cached block holds (once the step's forward has finished) the prefix its hash names:
        attention blocks from a block boundary, Mamba states exactly."""
        if not self._enabled:
            return
        for g, m in enumerate(self._managers):
            for h, block in m.cached.items():
                # block_key(block), inlined: this runs for every cached block after every operation
                content = self.effective((block.pool, block.block_id))
                bs = self._managers[g].block_size
                if (
                    content is None
                    or content[0] != g
                    or content[3] != ("H", h)
                    or (not isinstance(self._managers[g], MambaManager) and content[1] % bs)
                ):
                    self._log.fail(f"cached block {block!r} of group {g} holds {content and content[:3]}, not its hash")
