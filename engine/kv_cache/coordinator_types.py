"""The values a ``HybridCoordinator`` takes and hands out, and its per-pool argument checks.

``RetentionOptions`` configures the pinned retention tier, ``CacheHit`` is a prefix hit (per group,
the blocks to claim) and ``PoolStats`` one pool's capacity. ``_check_pools`` validates the groups'
pool indices; ``per_pool`` is the one rule for per-pool arguments (here and in
``engine.model.kv_layout`` and ``engine.runner``): one value for every pool, or one per pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar

from engine.kv_cache.block_pool import Block
from engine.kv_cache.request import CacheRequest

#: a per-pool value: a block count, or a block count that may be None (no cap)
PoolValue = TypeVar("PoolValue", int, int | None)
#: where a prefix pin keeps its blocks (``HybridCoordinator.pin_prefix``): ``"device"`` in the device
#: pools (moved to the host tier, still pinned, when the device must give them up), ``"host"`` in
#: the host tier only
PinTier = Literal["device", "host"]
PIN_TIERS: tuple[PinTier, ...] = ("device", "host")


@dataclass(frozen=True)
class RetentionOptions:
    """The pinned retention tier: on/off, the retained-tier cap, sliding-window anchors.

    ``budget_blocks`` caps each pool's retained tier: an int (or None: no cap) applies to every
    pool alike, a tuple gives one cap per pool.
    """

    enabled: bool = False
    budget_blocks: int | tuple[int | None, ...] | None = None
    pin_sliding_window: bool = True
    min_drop_blocks: int = 1


class CacheHit(NamedTuple):
    """A prefix hit: per group, the blocks to claim (null where not needed), and its length.

    ``shared_prefix_tokens`` is the deepest aligned boundary any group had cache for before
    reconciliation (where the request's chain diverges from cached chains). ``partial`` is set
    when Mamba groups were left out (remote prefill: their state is transferred).
    """

    blocks: tuple[list[Block], ...]
    num_tokens: int
    shared_prefix_tokens: int = 0
    partial: bool = False


@dataclass(frozen=True)
class PoolStats:
    """Capacity of one block pool: usable blocks (null excluded), free ones (pinned included, as an
    allocation may demote them), pinned ones, explicitly pinned ones, and usage in [0, 1]."""

    pool: int
    groups: tuple[int, ...]
    num_blocks: int
    free_blocks: int
    pinned_blocks: int
    explicitly_pinned_blocks: int
    usage: float


def _check_pools(group_pool: list[int]) -> int:
    """Number of pools the groups name; every index 0..P-1 must be used by some group."""
    if any(p < 0 for p in group_pool):
        raise ValueError(f"KVCacheGroup.pool: must be >= 0 (got {group_pool})")
    num_pools = max(group_pool) + 1
    unused = sorted(set(range(num_pools)) - set(group_pool))
    if unused:
        raise ValueError(f"KVCacheGroup.pool: pools {unused} are used by no group (groups use {group_pool})")
    return num_pools


def per_pool(name: str, value: PoolValue | Iterable[PoolValue], num_pools: int) -> list[PoolValue]:
    """One value per pool: an int (or None) applies to every pool alike; a sequence must give one
    value per pool (ValueError naming ``name`` otherwise)."""
    if value is None or isinstance(value, int):
        return [value] * num_pools
    values = list(value)
    if len(values) != num_pools:
        raise ValueError(f"{name}: {len(values)} values for {num_pools} pools")
    return values


class AdmittedRequest:
    """Coordinator-side bookkeeping of one admitted request."""

    __slots__ = ("cached_upto", "capacity", "next_drop", "removed_upto", "request", "shared_prefix")

    def __init__(self, request: CacheRequest, shared_prefix: int):
        self.request = request
        self.cached_upto = 0  # tokens (aligned) whose full blocks are registered
        self.shared_prefix = shared_prefix  # where its chain diverged from cached chains
        self.removed_upto = 0  # last computed count passed to remove_skipped_blocks
        # The decode fast path (``HybridCoordinator._allocate_running``, engine/kv_cache/coordinator.py):
        # every group's table covers ``capacity`` tokens, and no group drops a block before ``next_drop`` computed
        # tokens. Both are set by a slow-path running allocation (0 until then: slow path).
        self.capacity = 0
        self.next_drop = 0
