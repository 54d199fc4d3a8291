"""The block data model: what token prefix every physical block holds (``content``, with Mamba
states ``pending`` until the forward ends), written by computations and loads (``compute``,
``load``) and checked on every read; cached (sealed) blocks must never be overwritten.
"""

from __future__ import annotations

from engine.kv_cache import CacheRequest
from engine.kv_cache.attention_managers import ChunkedLocalManager, SlidingWindowManager
from engine.kv_cache.mamba_manager import MambaManager
from kvfleet_testing.kv_cache_sim.records import SimRequest, cdiv


class DataModel:
    """Mixin of ``Sim`` (owns no state; uses ``Sim.content`` and ``Sim.pending``): a read finds the
    request's own prefix in non-null blocks; a write never changes a block cached before this
    operation's allocation and not handed out since; a Mamba state is readable only after the
    step that wrote it."""

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
        bs = self.managers[g].block_size
        if j >= len(table) or table[j].is_null:
            self.fail(f"{what}: {req.request_id} group {g} reads positions {lo}..{hi} but index {j} is null/missing")
        bid = table[j].block_id
        content = self.content.get(self.key(table[j]))
        if content is None:
            self.fail(f"{what}: {req.request_id} group {g} reads block {bid} (index {j}) that was never written")
        group, first, end, key = content
        if (
            group != g
            or not (j * bs < end <= (j + 1) * bs)
            or first > lo
            or end < hi
            or self._prefix_key(req, end) != key
        ):
            self.fail(
                f"{what}: {req.request_id} group {g} index {j} block {bid} holds positions [{first}, {end}) of "
                f"another prefix / range, needs [{lo}, {hi}) of its own"
            )

    def _write(self, req: CacheRequest, g: int, table: list, j: int, lo: int, hi: int, what: str) -> None:
        bs = self.managers[g].block_size
        if j >= len(table) or table[j].is_null:
            self.fail(f"{what}: {req.request_id} group {g} writes positions {lo}..{hi} but index {j} is null/missing")
        block = table[j]
        old = self.content.get(self.key(block))
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
            self.fail(f"{what}: {req.request_id} group {g} writes into cached block {block!r} at index {j}")
        self.content[self.key(block)] = new

    @staticmethod
    def key(block) -> tuple[int, int]:
        """A block's identity across pools: (pool, block id)."""
        return block.pool, block.block_id

    def effective(self, bid: tuple[int, int]) -> tuple | None:
        """Contents once the current step's forward has finished (pending Mamba states included)."""
        pending = self.pending.get(bid)
        return pending[1] if pending is not None else self.content.get(bid)

    def commit(self, rid: str | None = None) -> None:
        """The forward finished (for ``rid``, or for everyone): pending Mamba states land."""
        for bid, (owner, content) in list(self.pending.items()):
            if rid is None or owner == rid:
                self.content[bid] = content
                del self.pending[bid]

    def _write_state(
        self, req: CacheRequest, g: int, table: list, length: int, what: str, deferred: bool = True
    ) -> None:
        bs = self.managers[g].block_size
        j = cdiv(length, bs) - 1
        if j >= len(table) or table[j].is_null:
            self.fail(f"{what}: {req.request_id} Mamba group {g} has no state block at index {j} for {length} tokens")
        block = table[j]
        key = self.key(block)
        new = (g, length, length, self._prefix_key(req, length))
        if self.effective(key) != new and self._sealed(block):
            self.fail(f"{what}: {req.request_id} Mamba group {g} overwrites cached state block {block!r}")
        if deferred:
            self.pending[key] = (req.request_id, new)
        else:
            self.pending.pop(key, None)
            self.content[key] = new

    def _sealed(self, block) -> bool:
        """A block whose contents must not change: cached before this operation's allocation and not
        handed out again since (eager caching hashes blocks just before their KV is written)."""
        key = self.key(block)
        return block.block_hash is not None and key in self.hashed_before and key not in self.fresh

    def _read_state(self, req: CacheRequest, g: int, table: list, length: int, what: str) -> None:
        bs = self.managers[g].block_size
        j = cdiv(length, bs) - 1
        if j >= len(table) or table[j].is_null:
            self.fail(f"{what}: {req.request_id} Mamba group {g} lost the state after {length} tokens (index {j})")
        bid = table[j].block_id
        if self.key(table[j]) in self.pending:
            self.fail(
                f"{what}: {req.request_id} Mamba group {g} reads block {bid}, "
                "whose state is written only at the end of this step"
            )
        content = self.content.get(self.key(table[j]))
        if content is None or content[:3] != (g, length, length) or content[3] != self._prefix_key(req, length):
            self.fail(
                f"{what}: {req.request_id} Mamba group {g} index {j} block {table[j].block_id} holds state "
                f"{content[:3] if content else None}, needs the state after its own {length} tokens"
            )

    def compute(self, r: SimRequest, start: int, end: int, what: str) -> None:
        """The forward pass of tokens [start, end): read what they attend to, write their KV/state."""
        if not self.data_model:
            return
        req = r.req
        rid = r.rid
        for g, m in enumerate(self.managers):
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
        if not self.data_model:
            return
        req = r.req
        for g, m in enumerate(self.managers):
            table = m.tables[r.rid]
            if isinstance(m, MambaManager):
                if end > 0:
                    self._write_state(req, g, table, end, what, deferred=False)
                continue
            bs = m.block_size
            for j in range(start // bs, cdiv(end, bs)):
                if j < len(table) and not table[j].is_null:
                    self._write(req, g, table, j, max(start, j * bs), min(end, (j + 1) * bs), what)
