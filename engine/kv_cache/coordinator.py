"""The hybrid coordinator: one or more block pools, any number of KV-cache groups, one answer per request.

Each group draws from the pool ``KVCacheGroup.pool`` names (one pool per page size, so no group
pays for another's page size); every pool has its own block ids 0..n-1 and its own null block.

Responsibilities, each over all groups (and pools) at once:
- the longest common prefix hit, by a fixed point over groups aligned to the LCM of their block
  sizes (a group whose rule fails lowers the candidate; non-full groups whose last hit is longer
  than the candidate are asked again until no group lowers it);
- two-phase allocation: every group claims its local hit blocks before any group takes blocks
  for external (transferred) tokens, so a claimed hit can never be handed out again;
- caching, window maintenance, freeing (per group, tail first; with one pool, every group's
  blocks in as few pool calls as the queue order allows);
- retention: sliding-window anchors at useful boundaries and explicit prefix pins;
- ``check_invariants()`` for tests.

This module holds construction, hits, allocation and caching; the rest of ``HybridCoordinator``
comes from its mixins: ``coordinator_views`` (capacity, block tables, events, invariants),
``prefix_pins`` (explicit pins, prefix-cache reset) and ``coordinator_release`` (freeing).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.kv_cache.block_pool import Block, BlockPool
from engine.kv_cache.coordinator_release import CoordinatorRelease
from engine.kv_cache.coordinator_types import (
    CacheHit,
    PoolStats,  # noqa: F401 (re-exported)
    RetentionOptions,
    _check_pools,
    _per_pool,
)
from engine.kv_cache.coordinator_views import _BLOCK_ID, CoordinatorViews
from engine.kv_cache.events import EventLog
from engine.kv_cache.invariants import KVCacheInvariantError, check_coordinator  # noqa: F401 (re-exported)
from engine.kv_cache.managers import (
    MANAGER_FOR_SPEC,
    FullAttentionManager,
    MambaManager,
    SingleTypeManager,
    SlidingWindowManager,
)
from engine.kv_cache.prefix_pins import PrefixPins, _PrefixPin
from engine.kv_cache.request import CacheRequest
from engine.kv_cache.spec import KVCacheGroup, SlidingWindowSpec, alignment_tokens, hash_block_size


_NEVER = 1 << 62  # a token count no request reaches


class _Admitted:
    """Coordinator-side bookkeeping of one admitted request."""

    __slots__ = ("request", "cached_upto", "shared_prefix", "removed_upto", "capacity", "next_drop")

    def __init__(self, request: CacheRequest, shared_prefix: int):
        self.request = request
        self.cached_upto = 0  # tokens (aligned) whose full blocks are registered
        self.shared_prefix = shared_prefix  # where its chain diverged from cached chains
        self.removed_upto = 0  # last computed count passed to remove_skipped_blocks
        # The decode fast path (``HybridCoordinator._allocate_running``): every group's table
        # covers ``capacity`` tokens, and no group drops a block before ``next_drop`` computed
        # tokens. Both are set by a slow-path running allocation (0 until then: slow path).
        self.capacity = 0
        self.next_drop = 0


class HybridCoordinator(CoordinatorViews, PrefixPins, CoordinatorRelease):
    """Owns the block pools and one manager per group; the scheduler's single KV-cache interface.

    Invariants (``check_invariants``), per pool: ref counts equal table references; a block is in
    exactly one free/pinned queue of its pool iff unreferenced; free + pinned + in use ==
    num_blocks - 1; a non-null block lives in one group only, and that group draws from the
    block's pool (a block never moves between pools); the hash maps match the blocks; each
    allocation took exactly the predicted number of blocks from every pool.
    """

    def __init__(
        self,
        groups: list[KVCacheGroup],
        num_blocks: int | Sequence[int],
        enable_caching: bool = True,
        retention: RetentionOptions = RetentionOptions(),  # noqa: B008 (frozen)
        enable_events: bool = False,
        max_model_len: int | None = None,
    ):
        if not groups:
            raise ValueError("groups: need at least one KV-cache group")
        self.groups = groups
        self.enable_caching = enable_caching
        self.retention = retention
        self.max_model_len = max_model_len
        self.hash_block_size = hash_block_size(groups)
        self.alignment = alignment_tokens(groups)
        self.group_pool: list[int] = [group.pool for group in groups]
        num_pools = _check_pools(self.group_pool)
        sizes = _per_pool("num_blocks", num_blocks, num_pools)
        budgets = _per_pool("retention.budget_blocks", retention.budget_blocks, num_pools)
        self.events = EventLog(enable_events)
        self.pools: list[BlockPool] = [
            BlockPool(
                size,
                len(groups),
                enable_caching=enable_caching,
                retain_budget=budget if retention.enabled else None,
                index=p,
                events=self.events,
            )
            for p, (size, budget) in enumerate(zip(sizes, budgets))
        ]
        self.pool = self.pools[0]  # the only pool of a single-pool coordinator
        self._single_pool = num_pools == 1
        self.managers: list[SingleTypeManager] = []
        for index, group in enumerate(groups):
            spec = group.spec
            pool = self.pools[group.pool]
            if isinstance(spec, SlidingWindowSpec):
                manager: SingleTypeManager = SlidingWindowManager(
                    spec,
                    index,
                    pool,
                    self.hash_block_size,
                    retain=retention.enabled and retention.pin_sliding_window and enable_caching,
                    min_drop_blocks=retention.min_drop_blocks,
                )
            else:
                manager = MANAGER_FOR_SPEC[type(spec)](spec, index, pool, self.hash_block_size)
            self.managers.append(manager)
        # Full attention first: its cheap, downward-closed scan gives the tightest first bound.
        self._order = sorted(range(len(groups)), key=lambda g: not isinstance(self.managers[g], FullAttentionManager))
        # (group, manager, full attention?, stable hits?) in ``_order``, for find_longest_cache_hit
        self._order_rules = [
            (g, self.managers[g], isinstance(self.managers[g], FullAttentionManager), self.managers[g].stable_hits)
            for g in self._order
        ]
        self._order_without_mamba = [rule for rule in self._order_rules if not isinstance(rule[1], MambaManager)]
        self._full_groups = [g for g in self._order if isinstance(self.managers[g], FullAttentionManager)]
        self._hash_factors = [m.hash_factor for m in self.managers]
        self._windowed = [m for m in self.managers if isinstance(m, SlidingWindowManager) and m.retain]
        self._droppers = [m for m in self.managers if not isinstance(m, FullAttentionManager)]
        self._mamba_flags = [isinstance(m, MambaManager) for m in self.managers]
        self._has_mamba = any(self._mamba_flags)
        self._retain_shared_prefix = retention.enabled and enable_caching
        # Retaining frees release all groups together (``_free_retaining_together``) when the
        # order of pool calls cannot matter between groups: one pool, no Mamba, no tier cap.
        self._free_together = self._single_pool and not self._has_mamba and self.pool.retain_budget is None
        self._no_hit: tuple[list[Block], ...] = tuple([] for _ in groups)
        self._no_new_ids: tuple[list[int], ...] = tuple([] for _ in groups)
        self._admitted: dict[str, _Admitted] = {}
        self._explicit_pins: Counter[tuple[int, bytes]] = Counter()
        self._prefix_pins: dict[tuple[int, bytes], _PrefixPin] = {}
        self._nothing_allocated: list[tuple[int, int]] = [(0, 0)] * num_pools
        self._last_allocation = self._nothing_allocated

    # -- hits -----------------------------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int, skip_mamba: bool = False) -> CacheHit:
        """Longest aligned prefix (<= max_length) that every group can serve. Pure lookup.

        A fixed point over the groups: each pass asks every group, in ``_order``, for its longest
        hit at most the running candidate, until no group lowers it. A full-attention group is
        asked once (its hits are downward closed), and a group whose last answer equals the
        candidate it is asked again with is not asked again (``SingleTypeManager.stable_hits``:
        it would give the same blocks).
        """
        managers = self.managers
        partial = skip_mamba and self._has_mamba
        if not self.enable_caching or max_length <= 0:
            return CacheHit(tuple([] for _ in managers), 0, 0, partial)
        alignment = self.alignment
        length = max_length - max_length % alignment
        order = self._order_without_mamba if skip_mamba else self._order_rules
        factors = self._hash_factors
        found: list[list[Block]] = [[] for _ in managers] if partial else [None] * len(managers)  # type: ignore[list-item]
        lengths = [-1] * len(managers)
        current = length
        for g, manager, _full, _stable in order:  # first pass: every group
            hashes = block_hashes if factors[g] == 1 else manager.view(block_hashes)
            found[g], current = manager.find_longest_cache_hit(hashes, current, alignment)
            lengths[g] = current
        # The first answer bounds every later one: the deepest boundary any group had cache for.
        shared = lengths[order[0][0]] if order else 0
        while current < length:  # later passes: only groups whose hit is longer than the candidate
            length = current
            for g, manager, full, stable in order:
                last = lengths[g]
                if full:
                    current = min(current, last)
                    continue
                if stable and last == current:
                    continue  # asked again, it would answer the same blocks
                hashes = block_hashes if factors[g] == 1 else manager.view(block_hashes)
                found[g], current = manager.find_longest_cache_hit(hashes, current, alignment)
                lengths[g] = current
        for g in self._full_groups:
            blocks = found[g]
            keep = -(-length // managers[g].block_size)
            if len(blocks) > keep:
                del blocks[keep:]
        return CacheHit(tuple(found), length, shared, partial)

    def get_computed_blocks(self, request: CacheRequest) -> CacheHit:
        """The local hit for a request not yet admitted (at most N - 1 tokens: the last token is
        always recomputed for its logits). Remote-prefill requests leave Mamba groups out."""
        return self.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1, skip_mamba=request.remote_prefill
        )

    # -- allocation ---------------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        num_external_tokens: int = 0,
        delay_cache: bool = False,
        reserved_blocks: int | Sequence[int] = 0,
    ) -> tuple[list[int], ...] | None:
        """Give ``request`` blocks for ``num_new_tokens`` tokens to compute now, after claiming
        ``hit`` (first admission) and making room for ``num_external_tokens`` transferred ones.

        Returns the new block ids per group (ids in that group's pool; treat as read-only), or
        None when some pool cannot fit its share (after keeping ``reserved_blocks`` free: an int
        for every pool, or one value per pool) — then nothing changed except releasing blocks that
        already left the window.
        """
        state = self._admitted.get(request.request_id)
        if state is not None:
            if hit is not None and hit.num_tokens or num_external_tokens:
                raise ValueError(f"request {request.request_id!r}: hits and external tokens are only taken at admission")
            return self._allocate_running(state, num_new_tokens, delay_cache, reserved_blocks)
        if num_new_tokens <= 0 and num_external_tokens <= 0:
            raise ValueError(f"num_new_tokens: must be > 0 when there are no external tokens (got {num_new_tokens})")
        return self._allocate_admission(request, num_new_tokens, hit, num_external_tokens, delay_cache, reserved_blocks)

    def _fits(self, predicted: list[int], reserved_blocks: int | Sequence[int]) -> list[int] | None:
        """Each pool's free count before the allocation, or None if some pool is short."""
        if self._single_pool and isinstance(reserved_blocks, int):
            free_now = self.pool.num_free_blocks
            return None if predicted[0] > free_now - reserved_blocks else [free_now]
        free = [pool.num_free_blocks for pool in self.pools]
        if isinstance(reserved_blocks, int):
            for p, n in enumerate(predicted):
                if n > free[p] - reserved_blocks:
                    return None
        else:
            reserved = _per_pool("reserved_blocks", reserved_blocks, len(free))
            for p, n in enumerate(predicted):
                if n > free[p] - reserved[p]:
                    return None
        return free

    def _record_allocation(self, predicted: list[int], free_before: list[int]) -> None:
        if self._single_pool:
            self._last_allocation = [(predicted[0], free_before[0] - self.pool.num_free_blocks)]
            return
        self._last_allocation = [(n, free_before[p] - self.pools[p].num_free_blocks) for p, n in enumerate(predicted)]

    def _allocate_running(
        self, state: _Admitted, num_new_tokens: int, delay_cache: bool, reserved_blocks: int | Sequence[int]
    ) -> tuple[list[int], ...] | None:
        request = state.request
        request_id = request.request_id
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens: must be > 0 for a running request (got {num_new_tokens})")
        total = request.num_computed_tokens
        need = total + num_new_tokens
        if self.max_model_len is not None and need > self.max_model_len:
            need = self.max_model_len
        if (
            need <= state.capacity
            and total < state.next_drop
            and reserved_blocks == 0
            and (num_new_tokens == 1 or not self._windowed)
        ):
            # Fast path (most decode steps): no group drops a block or needs a new one.
            state.removed_upto = total
            self._last_allocation = self._nothing_allocated
            if not delay_cache and need >= state.cached_upto + self.alignment:
                self._cache(state, need)
            return self._no_new_ids
        for manager in self._droppers:
            manager.remove_skipped_blocks(request_id, total)
        state.removed_upto = total
        predicted = [0] * len(self.pools)
        for manager in self.managers:
            predicted[manager.pool.index] += manager.num_new_blocks(request_id, need)
        free_before = self._fits(predicted, reserved_blocks)
        if free_before is None:
            return None
        new_ids = self._no_new_ids
        if any(predicted):
            new_ids = tuple([*map(_BLOCK_ID, m.allocate_new(request_id, need))] for m in self.managers)
        self._record_allocation(predicted, free_before)
        if num_new_tokens > 1:  # a prefill chunk ends here
            for manager in self._windowed:
                manager.add_boundary(request_id, need)  # type: ignore[attr-defined]
        if not delay_cache:
            self._cache(state, need)
        state.capacity = min([len(m.tables[request_id]) * m.block_size for m in self.managers])
        state.next_drop = min([m.next_skip_change(total) for m in self._droppers], default=_NEVER)
        return new_ids

    def _allocate_admission(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        hit: CacheHit | None,
        num_external_tokens: int,
        delay_cache: bool,
        reserved_blocks: int | Sequence[int],
    ) -> tuple[list[int], ...] | None:
        request_id = request.request_id
        managers = self.managers
        num_local = request.num_computed_tokens + (hit.num_tokens if hit is not None else 0)
        total = num_local + num_external_tokens
        if self.max_model_len is not None:
            total = min(total, self.max_model_len)
        need = total + num_new_tokens
        if self.max_model_len is not None:
            need = min(need, self.max_model_len)
        hit_blocks = hit.blocks if hit is not None else self._no_hit
        partial = hit is not None and hit.partial
        predicted = [0] * len(self.pools)
        for g, manager in enumerate(managers):
            force = num_external_tokens > 0 or (partial and self._mamba_flags[g])
            predicted[manager.pool.index] += manager.num_blocks_to_allocate(request_id, need, hit_blocks[g], total, force)
        free_before = self._fits(predicted, reserved_blocks)
        if free_before is None:
            return None

        state = _Admitted(request, hit.shared_prefix_tokens if hit is not None else 0)
        self._admitted[request_id] = state
        self._admit(request_id, hit_blocks, num_local, num_external_tokens, partial)
        new_ids = tuple([*map(_BLOCK_ID, manager.allocate_new(request_id, need))] for manager in managers)
        self._record_allocation(predicted, free_before)

        if self._windowed:
            if state.shared_prefix:
                for manager in self._windowed:
                    manager.add_boundary(request_id, state.shared_prefix)  # type: ignore[attr-defined]
            if num_new_tokens > 1:
                for manager in self._windowed:
                    manager.add_boundary(request_id, need)  # type: ignore[attr-defined]
        if not delay_cache:
            self._cache(state, need)
        return new_ids

    def _admit(
        self, request_id: str, hit_blocks: tuple[list[Block], ...], num_local: int, num_external: int, partial: bool
    ) -> None:
        """Two-phase admission: every group claims its local hit blocks (taking them out of the
        free and pinned queues) before any group takes fresh blocks for external tokens; otherwise
        one group's allocation could pop another group's not-yet-claimed hit block."""
        total = num_local + num_external
        for g, manager in enumerate(self.managers):  # phase 1
            manager.claim_hit(request_id, hit_blocks[g], total)
        for manager in self.managers:  # phase 2
            if num_external > 0 or (partial and isinstance(manager, MambaManager)):
                manager.allocate_external(request_id, num_local, num_external)

    def cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens`` (rounded down to the alignment),
        e.g. once a transfer into its blocks completed."""
        state = self._admitted.get(request.request_id)
        if state is not None:
            self._cache(state, num_tokens)

    def _cache(self, state: _Admitted, num_tokens: int) -> None:
        """Register the request's blocks once ``num_tokens`` tokens are computed (this step
        included): every group up to the aligned count; Mamba groups only a state that is
        exactly at it (``MambaManager.cache_blocks``)."""
        request = state.request
        exact = min(num_tokens, request.num_tokens)
        num_tokens = exact - exact % self.alignment
        if num_tokens <= state.cached_upto or not self.enable_caching:
            return
        state.cached_upto = num_tokens
        request_id = request.request_id
        hashes = request.block_hashes
        for manager in self.managers:
            manager.cache_blocks(request_id, manager.view(hashes), num_tokens, exact)

    def new_step(self) -> None:
        for manager in self.managers:
            manager.new_step()
