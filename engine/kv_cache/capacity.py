"""PoolCapacity: how full each of a coordinator's block pools is, read live (no state of its own)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.coordinator_types import PoolStats


class PoolCapacity:
    """Owns nothing but references: a ``HybridCoordinator``'s block pools and which pool each KV
    group draws from (``group_pool``). Every figure is read from the pools at the call; a pool's
    usable blocks exclude its null block; "free" counts the blocks an allocation may take (free
    plus pinned ones, demoted on demand)."""

    def __init__(self, pools: Sequence[BlockPool], group_pool: Sequence[int]):
        self.pools = pools
        self.group_pool = group_pool

    @property
    def tightest_pool(self) -> int:
        """The pool with the highest usage (the lowest index among equals)."""
        pools = self.pools
        if len(pools) == 1:
            return 0
        return max(range(len(pools)), key=lambda p: (pools[p].usage, -p))

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the tightest pool; with one pool, of the pool."""
        return self.pools[self.tightest_pool].num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use in the tightest pool (the one that refuses admissions first)."""
        return max(pool.usage for pool in self.pools)

    def num_blocks_in(self, pool: int) -> int:
        """Usable blocks of ``pool``."""
        return self.pools[pool].num_blocks - 1

    def num_free_blocks_in(self, pool: int) -> int:
        """Blocks of ``pool`` an allocation may take."""
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
                pinned_blocks=p.num_retained_blocks,
                explicitly_pinned_blocks=p.explicit.size,
                usage=p.usage,
            )
            for p in self.pools
        ]
