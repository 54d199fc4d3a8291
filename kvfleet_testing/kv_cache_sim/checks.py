"""The simulator's checks: a failed ``allocate_slots`` changes nothing but the requester's window
drops (``snapshot``, ``check_unchanged``, ``allocate``), the state after every operation (``check``:
invariants, event replay, data model, waiting-for-KV blocks, admitted set, free counts) and the
free-queue order of a freed request (``free_request``).
"""

from __future__ import annotations

from collections import Counter

from engine.kv_cache import (
    AllBlocksCleared,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    CacheHit,
)
from engine.kv_cache.block_queue import TIER_NONE
from engine.kv_cache.mamba_manager import MambaManager
from kvfleet_testing.kv_cache_sim.records import LOADING, RUNNING, SimRequest, Snapshot, cdiv


class SimChecks:
    """Mixin of ``Sim`` (owns no state): ``check()`` raises ``SimViolation`` (through ``fail``)
    unless the coordinator's invariants hold, the event stream replays gap-free to its hash maps
    and pin levels, every cached block holds the prefix its hash names and the admitted set is the
    simulator's RUNNING and LOADING requests."""

    # -- snapshots for failed allocations --------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return Snapshot(
            refs=[[b.ref_cnt for b in pool.blocks] for pool in self.pools],
            cached=[{h: b.block_id for h, b in m.cached.items()} for m in self.managers],
            tables={rid: self.coord.block_ids(rid) for rid in self.coord.requests},
            admitted=set(self.coord.requests),
        )

    def check_unchanged(self, rid: str, before: Snapshot, computed: int) -> None:
        """A failed allocate_slots: only window drops of ``rid`` (slots before its skipped range at
        ``computed`` tokens becoming null) may have happened."""
        after = self.snapshot()
        if after.admitted != before.admitted:
            self.fail(f"failed allocation for {rid} changed the admitted set")
        if after.cached != before.cached:
            self.fail(f"failed allocation for {rid} changed the prefix-cache maps")
        null_id = self.coord.null_block_id
        released: Counter[tuple[int, int]] = Counter()  # (pool, block id)
        for other, tables in before.tables.items():
            now = after.tables[other]
            if other != rid:
                if now != tables:
                    self.fail(f"failed allocation for {rid} changed the table of {other}")
                continue
            for g, (old, new) in enumerate(zip(tables, now, strict=False)):
                if len(old) != len(new):
                    self.fail(f"failed allocation for {rid} resized its group {g} table")
                spec = self.managers[g].spec
                skipped = spec.skipped_tokens(computed) // spec.block_size
                for i, (a, b) in enumerate(zip(old, new, strict=False)):
                    if a != b:
                        if b != null_id or i >= skipped:
                            self.fail(f"failed allocation for {rid} replaced group {g} index {i}: {a} -> {b}")
                        released[(self.group_pool[g], a)] += 1
        for p, (refs_before, refs_after) in enumerate(zip(before.refs, after.refs, strict=False)):
            for bid, (a, b) in enumerate(zip(refs_before, refs_after, strict=False)):
                if bid == null_id:
                    continue
                if a - b != released.get((p, bid), 0):
                    self.fail(
                        f"failed allocation for {rid}: block {bid} of pool {p} ref {a} -> {b}, "
                        f"released {released.get((p, bid), 0)}"
                    )

    def _mamba_deferred(self, hit: CacheHit | None) -> bool:
        if hit is None:
            return False
        for g, m in enumerate(self.managers):
            if isinstance(m, MambaManager) and hit.blocks[g] and hit.blocks[g][-1].block_hash in m.cached_this_step:
                return True
        return False

    def allocate(
        self,
        r: SimRequest,
        num_new: int,
        hit: CacheHit | None = None,
        ext: int = 0,
        delay: bool = False,
        reserved: int = 0,
    ) -> list[list[int]] | None:
        req = r.req
        before = self.snapshot()
        self.hashed_before = {
            (self.group_pool[g], bid) for g, table in enumerate(before.cached) for bid in table.values()
        }
        deferred = self._mamba_deferred(hit)
        ids = self.coord.allocate_slots(
            req, num_new, hit=hit, num_external_tokens=ext, delay_cache=delay, reserved_blocks=reserved
        )
        self.note(
            f"allocate_slots({r.rid}, new={num_new}, hit={hit.num_tokens if hit else None}, ext={ext}, "
            f"delay={delay}, reserved={reserved}) -> {'None' if ids is None else 'ok'}"
        )
        if ids is None:
            self.tag("alloc_fail")
            if deferred:
                self.tag("mamba_same_step_defer")
            self.check_unchanged(r.rid, before, req.num_computed_tokens)
            need = req.num_computed_tokens + (hit.num_tokens if hit else 0) + ext + num_new
            bound = [0] * len(self.pools)
            for g, m in enumerate(self.managers):
                bound[self.group_pool[g]] += 3 if isinstance(m, MambaManager) else cdiv(need, m.block_size)
            free = [pool.num_free_blocks for pool in self.pools]
            if not deferred and all(f - reserved >= n for f, n in zip(free, bound, strict=False)):
                self.fail(
                    f"allocate_slots({r.rid}, {num_new}) failed with {free} free blocks per pool, "
                    f"reserved {reserved}, while at most {bound} are needed"
                )
            self.check()
        return ids

    # ------------------------------------------------------------------------------------------------
    # checks after every operation
    def check(self) -> None:
        self.fresh.clear()
        self.hashed_before = set()
        self.coord.check_invariants()
        if self.cfg.enable_events:
            for event in self.coord.take_events():
                if event.seq != self.last_seq + 1:
                    self.fail(f"event sequence gap: {self.last_seq} -> {event.seq}")
                self.last_seq = event.seq
                if not isinstance(event, AllBlocksCleared) and event.pool != self.group_pool[event.group]:
                    self.fail(f"{type(event).__name__} of group {event.group} names pool {event.pool}")
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        key = (event.group, h)
                        if key in self.stored:
                            # The pool moved the entry to a fresher copy of the same content; the
                            # hash stays hittable, so a set-based index is unaffected.
                            self.tag("stored_again")
                        self.stored.add(key)
                elif isinstance(event, BlockRemoved):
                    self.tag("evicted")
                    for h in event.block_hashes:
                        key = (event.group, h)
                        if key not in self.stored:
                            self.fail(f"BlockRemoved for a hash never stored in group {event.group}")
                        if key in self.pinned:
                            self.fail(f"BlockRemoved for a pinned hash in group {event.group}")
                        self.stored.discard(key)
                elif isinstance(event, BlockPinned):
                    level = 2 if event.explicit else 1
                    self.tag("pinned_explicit" if event.explicit else "pinned_retained")
                    for h in event.block_hashes:
                        key = (event.group, h)
                        if key not in self.stored or self.pinned.get(key, 0) >= level:
                            self.fail(f"BlockPinned(explicit={event.explicit}) for an unstored or already pinned hash")
                        self.pinned[key] = level
                elif isinstance(event, BlockUnpinned):
                    for h in event.block_hashes:
                        key = (event.group, h)
                        if key not in self.pinned:
                            self.fail(f"BlockUnpinned for a hash that is not pinned (group {event.group})")
                        del self.pinned[key]
                elif isinstance(event, AllBlocksCleared):
                    self.stored.clear()
                    self.pinned.clear()
            actual = {(g, h) for g, m in enumerate(self.managers) for h in m.cached}
            if actual != self.stored:
                self.fail(
                    f"event replay disagrees with the pool: {len(actual - self.stored)} cached but not announced, "
                    f"{len(self.stored - actual)} announced but not cached"
                )
            pins = {(b.group, b.block_hash): b.tier for pool in self.pools for b in pool.blocks if b.tier != TIER_NONE}
            if pins != self.pinned:
                self.fail(f"event replay disagrees with pin levels: {len(pins)} pinned vs {len(self.pinned)} announced")
        if self.data_model:
            for g, m in enumerate(self.managers):
                for h, block in m.cached.items():
                    content = self.effective(self.key(block))
                    bs = self.managers[g].block_size
                    if (
                        content is None
                        or content[0] != g
                        or content[3] != ("H", h)
                        or (not isinstance(self.managers[g], MambaManager) and content[1] % bs)
                    ):
                        self.fail(f"cached block {block!r} of group {g} holds {content and content[:3]}, not its hash")
        for r in self.live(LOADING):
            local, _ = r.load  # type: ignore[misc]
            for g, m in enumerate(self.managers):
                table = m.tables[r.rid]
                for j in range(local // m.block_size, len(table)):
                    b = table[j]
                    if not b.is_null and (b.block_hash is not None or b.ref_cnt != 1):
                        self.fail(f"{r.rid} waits for KV but its group {g} index {j} block is {b!r}")
        admitted = {r.rid for r in self.reqs.values() if r.state in (RUNNING, LOADING)}
        if set(self.coord.requests) != admitted:
            self.fail(f"coordinator admits {sorted(self.coord.requests)}, simulator {sorted(admitted)}")
        for p, pool in enumerate(self.pools):
            if not 0 <= pool.num_free_blocks <= pool.num_blocks - 1:
                self.fail(f"pool {p}: num_free_blocks {pool.num_free_blocks} out of range")
            if self.coord.capacity.num_free_blocks_in(p) != pool.num_free_blocks:
                self.fail(f"num_free_blocks_in({p}) disagrees with the pool")
        tight = max(range(len(self.pools)), key=lambda p: (self.pools[p].usage, -p))
        if (
            self.coord.num_free_blocks != self.pools[tight].num_free_blocks
            or self.coord.usage != self.pools[tight].usage
        ):
            self.fail("num_free_blocks/usage do not describe the tightest pool")

    def free_request(self, rid: str) -> None:
        """coord.free, then invariant 16: within each group, the request's blocks that went to the free
        queue are ordered uncached first, then cached ones chain tail first (higher index earlier)."""
        self.commit(rid)  # frees are processed once the request's forward has finished
        tables = [list(m.tables.get(rid, ())) for m in self.managers]
        # Explicitly pinned blocks go to their tier. (With retention, freeing may also pin blocks
        # and demote others to the tail over budget: the order is then a retention policy.)
        pinned = {self.key(b) for table in tables for b in table if b.tier}
        self.coord.free(rid)
        if not any(tables) or self.cfg.retention.enabled:
            return
        for g, table in enumerate(tables):
            pool = self.pools[self.group_pool[g]]
            position = {b.block_id: i for i, b in enumerate(pool.free_queue)}
            freed = [
                (j, b)
                for j, b in enumerate(table)
                if not b.is_null and b.block_id in position and self.key(b) not in pinned
            ]
            cached = [position[b.block_id] for j, b in sorted(freed, key=lambda jb: -jb[0]) if b.block_hash is not None]
            uncached = [position[b.block_id] for _, b in freed if b.block_hash is None]
            if cached != sorted(cached) or (cached and uncached and max(uncached) > cached[0]):
                self.fail(f"free({rid}) group {g}: free-queue order of the released blocks is not tail first")
