"""The simulator's checks: a failed ``allocate_slots`` changes nothing but the requester's window
drops (``snapshot``, ``check_unchanged``, ``allocate``), the state after every operation (``check``:
invariants, event replay, data model, waiting-for-KV blocks, admitted set, free counts), the
free-queue order of a freed request (``free_request``) and a whole pool after ``drain``
(``check_drained``).
"""

from __future__ import annotations

from collections import Counter

from engine.kv_cache import CacheHit, HybridCoordinator
from engine.kv_cache.block_queue import TIER_EXPLICIT
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.manager_base import SingleTypeManager
from kvfleet_testing.kv_cache_sim.data_model import DataModel, block_key
from kvfleet_testing.kv_cache_sim.event_shadow import EventShadow
from kvfleet_testing.kv_cache_sim.log import SimLog
from kvfleet_testing.kv_cache_sim.records import LOADING, SimRequest, Snapshot, cdiv
from kvfleet_testing.kv_cache_sim.request_book import RequestBook


class SimChecks:
    """The checks of one simulator run over its coordinator. Owns no simulated state: it reads the
    coordinator, the requests (``RequestBook``), the data model and the event shadow (``None``
    when the configuration has no events) it is given, and reports through ``log.fail``.
    ``check()`` raises ``SimViolation`` unless the coordinator's invariants hold, the event stream
    replays gap-free to its hash maps and pin levels, every cached block holds the prefix its hash
    names, requests waiting for KV own unhashed, exclusively held blocks past their local hit and
    the admitted set is the simulator's RUNNING and LOADING requests. A failed ``allocate`` changes
    nothing but the requester's window drops; a freed request's blocks enter the free queue tail
    first (``free_request``)."""

    def __init__(
        self,
        coord: HybridCoordinator,
        requests: RequestBook,
        data: DataModel,
        shadow: EventShadow | None,
        log: SimLog,
        retention_enabled: bool,
    ) -> None:
        self._coord = coord
        self._managers: list[SingleTypeManager] = coord.managers
        self._pools = coord.pools
        self._group_pool = coord.group_pool
        self._requests = requests
        self._data = data
        self._shadow = shadow
        self._log = log
        self._retention_enabled = retention_enabled

    # -- snapshots for failed allocations --------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The coordinator's state a failed allocation must leave unchanged."""
        return Snapshot(
            refs=[[b.ref_cnt for b in pool.blocks] for pool in self._pools],
            cached=[{h: b.block_id for h, b in m.cached.items()} for m in self._managers],
            tables={rid: self._coord.block_ids(rid) for rid in self._coord.requests},
            admitted=set(self._coord.requests),
        )

    def check_unchanged(self, rid: str, before: Snapshot, computed: int) -> None:
        """A failed allocate_slots: only window drops of ``rid`` (slots before its skipped range at
        ``computed`` tokens becoming null) may have happened."""
        after = self.snapshot()
        if after.admitted != before.admitted:
            self._log.fail(f"failed allocation for {rid} changed the admitted set")
        if after.cached != before.cached:
            self._log.fail(f"failed allocation for {rid} changed the prefix-cache maps")
        null_id = self._coord.null_block_id
        released: Counter[tuple[int, int]] = Counter()  # (pool, block id)
        for other, tables in before.tables.items():
            now = after.tables[other]
            if other != rid:
                if now != tables:
                    self._log.fail(f"failed allocation for {rid} changed the table of {other}")
                continue
            for g, (old, new) in enumerate(zip(tables, now, strict=False)):
                if len(old) != len(new):
                    self._log.fail(f"failed allocation for {rid} resized its group {g} table")
                spec = self._managers[g].spec
                skipped = spec.skipped_tokens(computed) // spec.block_size
                for i, (a, b) in enumerate(zip(old, new, strict=False)):
                    if a != b:
                        if b != null_id or i >= skipped:
                            self._log.fail(f"failed allocation for {rid} replaced group {g} index {i}: {a} -> {b}")
                        released[(self._group_pool[g], a)] += 1
        for p, (refs_before, refs_after) in enumerate(zip(before.refs, after.refs, strict=False)):
            for bid, (a, b) in enumerate(zip(refs_before, refs_after, strict=False)):
                if bid == null_id:
                    continue
                if a - b != released.get((p, bid), 0):
                    self._log.fail(
                        f"failed allocation for {rid}: block {bid} of pool {p} ref {a} -> {b}, "
                        f"released {released.get((p, bid), 0)}"
                    )

    def _mamba_deferred(self, hit: CacheHit | None) -> bool:
        if hit is None:
            return False
        for g, m in enumerate(self._managers):
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
    ) -> tuple[list[int], ...] | None:
        """``coord.allocate_slots`` for ``r``; on failure, check that nothing changed but its window
        drops and that the pools had no obvious room, then ``check()``. Returns the block ids or None."""
        req = r.req
        before = self.snapshot()
        self._data.begin_allocation(
            {(self._group_pool[g], bid) for g, table in enumerate(before.cached) for bid in table.values()}
        )
        deferred = self._mamba_deferred(hit)
        ids = self._coord.allocate_slots(
            req, num_new, hit=hit, num_external_tokens=ext, delay_cache=delay, reserved_blocks=reserved
        )
        self._log.note(
            f"allocate_slots({r.rid}, new={num_new}, hit={hit.num_tokens if hit else None}, ext={ext}, "
            f"delay={delay}, reserved={reserved}) -> {'None' if ids is None else 'ok'}"
        )
        if ids is None:
            self._log.tag("alloc_fail")
            if deferred:
                self._log.tag("mamba_same_step_defer")
            self.check_unchanged(r.rid, before, req.num_computed_tokens)
            need = req.num_computed_tokens + (hit.num_tokens if hit else 0) + ext + num_new
            bound = [0] * len(self._pools)
            for g, m in enumerate(self._managers):
                bound[self._group_pool[g]] += 3 if isinstance(m, MambaManager) else cdiv(need, m.block_size)
            free = [pool.num_free_blocks for pool in self._pools]
            if not deferred and all(f - reserved >= n for f, n in zip(free, bound, strict=False)):
                self._log.fail(
                    f"allocate_slots({r.rid}, {num_new}) failed with {free} free blocks per pool, "
                    f"reserved {reserved}, while at most {bound} are needed"
                )
            self.check()
        return ids

    # ------------------------------------------------------------------------------------------------
    # checks after every operation
    def check(self) -> None:
        """The state between operations (see the class docstring); ends the data model's operation."""
        self._data.end_operation()
        coord = self._coord
        coord.check_invariants()
        if self._shadow is not None:
            self._shadow.replay()
        self._data.check_cached()
        for r in self._requests.live(LOADING):
            local, _ = r.load  # type: ignore[misc]
            for g, m in enumerate(self._managers):
                table = m.tables[r.rid]
                for j in range(local // m.block_size, len(table)):
                    b = table[j]
                    if not b.is_null and (b.block_hash is not None or b.ref_cnt != 1):
                        self._log.fail(f"{r.rid} waits for KV but its group {g} index {j} block is {b!r}")
        admitted = self._requests.admitted_ids()
        if set(coord.requests) != admitted:
            self._log.fail(f"coordinator admits {sorted(coord.requests)}, simulator {sorted(admitted)}")
        pools = self._pools
        for p, pool in enumerate(pools):
            if not 0 <= pool.num_free_blocks <= pool.num_blocks - 1:
                self._log.fail(f"pool {p}: num_free_blocks {pool.num_free_blocks} out of range")
            if coord.capacity.num_free_blocks_in(p) != pool.num_free_blocks:
                self._log.fail(f"num_free_blocks_in({p}) disagrees with the pool")
        tight = max(range(len(pools)), key=lambda p: (pools[p].usage, -p))
        if coord.num_free_blocks != pools[tight].num_free_blocks or coord.usage != pools[tight].usage:
            self._log.fail("num_free_blocks/usage do not describe the tightest pool")

    def check_drained(self) -> None:
        """After every request was aborted and every pin undone: every pool is whole, no block is
        referenced or explicitly pinned and the coordinator's pin bookkeeping is empty."""
        for p, pool in enumerate(self._pools):
            if pool.num_free_blocks != pool.num_blocks - 1:
                self._log.fail(
                    f"after draining pool {p} has {pool.num_free_blocks} free blocks, expected {pool.num_blocks - 1}"
                )
            if any(b.ref_cnt for b in pool.blocks if not b.is_null):
                self._log.fail(f"after draining some block of pool {p} is still referenced")
        left = [b for pool in self._pools for b in pool.blocks if b.tier == TIER_EXPLICIT]
        explicit = sum(pool.explicit.size for pool in self._pools)
        # The coordinator's pin bookkeeping (``PrefixPins``) must be empty too.
        books = {"device pins": len(self._coord.pins.device), "pin records": len(self._coord.pins.records)}
        if left or explicit or any(books.values()):
            self._log.fail(
                f"after unpinning every pin: {len(left)} blocks still explicitly pinned, explicit tiers "
                f"{explicit}, pin bookkeeping {books}"
            )

    def free_request(self, rid: str) -> None:
        """coord.free, then invariant 16: within each group, the request's blocks that went to the free
        queue are ordered uncached first, then cached ones chain tail first (higher index earlier)."""
        self._data.commit(rid)  # frees are processed once the request's forward has finished
        tables = [list(m.tables.get(rid, ())) for m in self._managers]
        # Explicitly pinned blocks go to their tier. (With retention, freeing may also pin blocks
        # and demote others to the tail over budget: the order is then a retention policy.)
        pinned = {block_key(b) for table in tables for b in table if b.tier}
        self._coord.free(rid)
        if not any(tables) or self._retention_enabled:
            return
        for g, table in enumerate(tables):
            pool = self._pools[self._group_pool[g]]
            position = {b.block_id: i for i, b in enumerate(pool.free_queue)}
            freed = [
                (j, b)
                for j, b in enumerate(table)
                if not b.is_null and b.block_id in position and block_key(b) not in pinned
            ]
            cached = [position[b.block_id] for j, b in sorted(freed, key=lambda jb: -jb[0]) if b.block_hash is not None]
            uncached = [position[b.block_id] for _, b in freed if b.block_hash is None]
            if cached != sorted(cached) or (cached and uncached and max(uncached) > cached[0]):
                self._log.fail(f"free({rid}) group {g}: free-queue order of the released blocks is not tail first")
