"""Read-only views of a ``HybridCoordinator``: pool capacity, block tables, the event feed, invariants.

What the scheduler reads to admit requests (per-pool free blocks and usage), what the runner and
the transfer layer read (block ids per group), and what the router reads (event sequence number,
prefix-cache snapshot, the drained event stream). ``take_events`` is the only method here that
changes anything: it drains the event log.
"""

from __future__ import annotations

from operator import attrgetter

from engine.kv_cache.block_queue import Block
from engine.kv_cache.coordinator_types import PoolStats
from engine.kv_cache.events import KVEvent
from engine.kv_cache.invariants import check_coordinator
from engine.kv_cache.request import CacheRequest

_BLOCK_ID = attrgetter("block_id")
_NO_BLOCKS: list[Block] = []


class CoordinatorViews:
    """The ``HybridCoordinator`` methods that read its pools and managers (mixin, no state of its own).

    Owns nothing: every value is computed from the coordinator's ``pools``, ``managers``,
    ``group_pool``, ``_admitted`` and ``events`` on each call. Invariant: no method here changes a
    pool, a manager or an admitted request (``take_events`` only drains the event log).
    """


    # -- capacity ------------------------------------------------------------------------------------
    @property
    def num_pools(self) -> int:
        return len(self.pools)

    @property
    def tightest_pool(self) -> int:
        """The pool with the highest usage (the lowest index among equals)."""
        pools = self.pools
        if len(pools) == 1:
            return 0
        return max(range(len(pools)), key=lambda p: (pools[p].usage, -p))

    @property
    def num_free_blocks(self) -> int:
        """Free (incl. pinned, demotable) blocks of the tightest pool; with one pool, of the pool."""
        return self.pools[self.tightest_pool].num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use in the tightest pool (the one that refuses admissions first)."""
        return max(pool.usage for pool in self.pools)

    def num_blocks_in(self, pool: int) -> int:
        """Usable blocks of ``pool`` (its null block excluded)."""
        return self.pools[pool].num_blocks - 1

    def num_free_blocks_in(self, pool: int) -> int:
        """Blocks of ``pool`` an allocation may take (free plus pinned ones, demoted on demand)."""
        return self.pools[pool].num_free_blocks

    def pool_usage(self, pool: int) -> float:
        """Fraction of ``pool``'s usable blocks in use."""
        return self.pools[pool].usage

    def pool_stats(self) -> list[PoolStats]:
        """Capacity of every pool, in pool order (what a worker reports per pool)."""
        return [
            PoolStats(
                pool=p.index,
                groups=tuple(g for g, q in enumerate(self.group_pool) if q == p.index),
                num_blocks=p.num_blocks - 1,
                free_blocks=p.num_free_blocks,
                pinned_blocks=p.num_pinned_free_blocks,
                explicitly_pinned_blocks=p.explicit.size,
                usage=p.usage,
            )
            for p in self.pools
        ]

    # -- views for the runner and the transfer layer ------------------------------------------------------
    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table per group (null slots carry the null block's id)."""
        return [[*map(_BLOCK_ID, m.tables.get(request_id, ()))] for m in self.managers]

    def live_tables(self, request_id: str) -> list[list[Block]]:
        """The request's block table per group as the managers' own lists of ``Block`` (read-only
        to the caller): no copy, so a decode step costs no per-block work. A list changes in place
        as the request grows (new blocks appended, sliding-window blocks that left the window
        replaced by the null block) and is replaced by a new list when the request is freed and
        admitted again (preemption)."""
        return [m.tables.get(request_id, _NO_BLOCKS) for m in self.managers]

    def unhashed_block_ids(self, request_id: str) -> list[list[int]]:
        """Per group, the request's real blocks that carry no hash yet (new or to be transferred)."""
        return [
            [b.block_id for b in m.tables.get(request_id, ()) if not b.is_null and b.block_hash is None]
            for m in self.managers
        ]

    @property
    def requests(self) -> dict[str, CacheRequest]:
        """Admitted requests by id."""
        return {rid: state.request for rid, state in self._admitted.items()}

    @property
    def null_block_id(self) -> int:
        """The null block's id: the same (0) in every pool."""
        return self.pool.null_block.block_id

    # -- events and maintenance ------------------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """Drain the KV events of every pool since the last call (one sequence, in order)."""
        return self.events.take()

    # -- invariants ---------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise KVCacheInvariantError if any structural invariant of the cache is broken
        (``engine.kv_cache.invariants`` lists them)."""
        check_coordinator(self)

    # -- read-only views for the router ---------------------------------------------------------------
    @property
    def event_seq(self) -> int:
        """Sequence number of the last KV event this worker emitted (0 before the first)."""
        return self.events.seq

    def snapshot(self) -> tuple[int, tuple[dict[bytes, int], ...]]:
        """``(event_seq, per-group {hash: pin level})`` of the prefix cache over all pools: what a
        router resyncs from after a gap in the event stream. The dicts are fresh copies."""
        return self.events.seq, tuple({h: block.pin for h, block in m.cached.items()} for m in self.managers)
