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
- the host tier (optional, ``engine.kv_cache.host_tier``): evicted cached blocks offloaded to host
  pools, hits looked up in both tiers per group, host blocks of a hit promoted at admission;
  pinned blocks stay pinned in the host tier (``pin_prefix``'s ``tier``);
- ``check_invariants()`` for tests.

``HybridCoordinator`` lives whole here: construction, hits, allocation and caching, then its
read-only views (capacity, block tables, the event feed, invariants), explicit prefix pins (a
prefix pin keeps, in every group, the blocks a hit at the prefix's end needs in the explicit tier
of the device pool, or of the host pool for a host-tier pin; pins of one prefix are counted) and
block release (``free``,
``remove_skipped_blocks``, ``discard_uncomputed``).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter

from engine.kv_cache.attention_managers import NEVER_SKIPS, FullAttentionManager, SlidingWindowManager
from engine.kv_cache.block_pool import Block, BlockPool
from engine.kv_cache.capacity import PoolCapacity
from engine.kv_cache.coordinator_types import (
    AdmittedRequest,
    CacheHit,
    PinTier,
    RetentionOptions,
    _check_pools,
    per_pool,
)
from engine.kv_cache.events import AllBlocksCleared, EventLog, KVEvent
from engine.kv_cache.hit_leases import HitLeases
from engine.kv_cache.host_tier import HostTier, TierCopy
from engine.kv_cache.invariants import check_coordinator, check_host_tier
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.manager_base import SingleTypeManager
from engine.kv_cache.managers import MANAGER_FOR_SPEC
from engine.kv_cache.prefix_pins import PrefixPins
from engine.kv_cache.request import CacheRequest
from engine.kv_cache.spec import KVCacheGroup, SlidingWindowSpec, alignment_tokens, hash_block_size

_BLOCK_ID = attrgetter("block_id")
_NO_BLOCKS: list[Block] = []


class HybridCoordinator:
    """Owns the block pools and one manager per group; the scheduler's single KV-cache interface.

    Invariants (``check_invariants``), per pool: ref counts equal table references; a block is in
    exactly one free/pinned queue of its pool iff unreferenced; free + pinned + in use ==
    num_blocks - 1; a non-null block lives in one group only, and that group draws from the
    block's pool (a block never moves between pools); the hash maps match the blocks; each
    allocation took exactly the predicted number of blocks from every pool. Prefix pins: as
    ``PrefixPins`` (``self.pins``) states them; ``reset_prefix_cache`` forgets them all. Release: a freed
    request leaves ``_admitted`` and holds no block in any group; ``free`` of an unknown request is
    a no-op; each group releases its blocks tail first.
    """

    def __init__(
        self,
        groups: list[KVCacheGroup],
        num_blocks: int | Sequence[int],
        enable_caching: bool = True,
        retention: RetentionOptions = RetentionOptions(),  # noqa: B008 (frozen)
        enable_events: bool = False,
        max_model_len: int | None = None,
        host_blocks: int | Sequence[int] | None = None,
    ):
        """``host_blocks``: blocks of each pool's host pool (an int: every pool alike; null block
        included, as ``num_blocks``); None: no host tier."""
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
        sizes = per_pool("num_blocks", num_blocks, num_pools)
        budgets = per_pool("retention.budget_blocks", retention.budget_blocks, num_pools)
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
            for p, (size, budget) in enumerate(zip(sizes, budgets, strict=True))
        ]
        self.pool = self.pools[0]  # the only pool of a single-pool coordinator
        #: how full each pool is (read live from the pools)
        self.capacity = PoolCapacity(self.pools, self.group_pool)
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
        self._admitted: dict[str, AdmittedRequest] = {}
        self._nothing_allocated: list[tuple[int, int]] = [(0, 0)] * num_pools
        self._last_allocation = self._nothing_allocated
        # The host tier: per group, the device map and the map over both tiers (device first);
        # ``find_longest_cache_hit`` points each manager's ``cached`` at the latter for a lookup.
        self.host: HostTier | None = None
        #: runs queued copies to completion (the engine's runner); called when an admission with
        #: transferred tokens queued copies, since a transfer is not ordered after queued copies
        self.copy_now: Callable[[list[TierCopy]], None] | None = None
        self._device_maps: list[dict[bytes, Block]] = [pool.cached[g] for g, pool in self._group_pools()]
        self._tiered_maps: list[Mapping[bytes, Block]] = []
        if host_blocks is not None and enable_caching:
            host = HostTier(per_pool("host_blocks", host_blocks, num_pools), len(groups), self.events, self.is_pinned)
            for p, pool in enumerate(self.pools):
                pool.offload = host.offloader(p)
            self._tiered_maps = [
                ChainMap(pool.cached[g], host.pools[pool.index].cached[g]) for g, pool in self._group_pools()
            ]
            self.host = host
        self.pins = PrefixPins(
            self.managers, self.group_pool, self.hash_block_size, self.host, self.find_longest_cache_hit
        )
        #: predicted hits held for requests routed here, from arrival to admission (``HitLeases``)
        self.leases = HitLeases(self.managers, self.host, self.find_longest_cache_hit)

    def _group_pools(self) -> list[tuple[int, BlockPool]]:
        return [(g, self.pools[p]) for g, p in enumerate(self.group_pool)]

    # -- hits -----------------------------------------------------------------------------------------
    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_length: int, skip_mamba: bool = False, include_host: bool = True
    ) -> CacheHit:
        """Longest aligned prefix (<= max_length) that every group can serve. Pure lookup.

        With a host tier (and ``include_host``) a group serves a length when each block its rule
        needs is in either tier; the hit then names host blocks (``HostTier.is_host``) where the
        device has none, which admission promotes. ``include_host=False``: device blocks only.

        A fixed point over the groups: each pass asks every group, in ``_order``, for its longest
        hit at most the running candidate, until no group lowers it. A full-attention group is
        asked once (its hits are downward closed), and a group whose last answer equals the
        candidate it is asked again with is not asked again (``SingleTypeManager.stable_hits``:
        it would give the same blocks).
        """
        if include_host and self.host is not None:
            return self._find_in_both_tiers(block_hashes, max_length, skip_mamba)
        managers = self.managers
        partial = skip_mamba and self._has_mamba
        if not self.enable_caching or max_length <= 0:
            return CacheHit(tuple([] for _ in managers), 0, 0, partial)
        alignment = self.alignment
        length = max_length - max_length % alignment
        order = self._order_without_mamba if skip_mamba else self._order_rules
        factors = self._hash_factors
        found: list[list[Block]] = [[] for _ in managers] if partial else [None] * len(managers)  # type: ignore[list-item]  # filled by the first pass, but for the groups it skips
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

    def _find_in_both_tiers(self, block_hashes: list[bytes], max_length: int, skip_mamba: bool) -> CacheHit:
        """The fixed point with every manager's map pointed at both tiers (device first)."""
        managers = self.managers
        for manager, tiered in zip(managers, self._tiered_maps, strict=True):
            manager.cached = tiered  # type: ignore[assignment]  # the hit rules only read get / [] / in
        try:
            return self.find_longest_cache_hit(block_hashes, max_length, skip_mamba, include_host=False)
        finally:
            for manager, device in zip(managers, self._device_maps, strict=True):
                manager.cached = device

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
            if (hit is not None and hit.num_tokens) or num_external_tokens:
                raise ValueError(
                    f"request {request.request_id!r}: hits and external tokens are only taken at admission"
                )
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
            reserved = per_pool("reserved_blocks", reserved_blocks, len(free))
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
        self, state: AdmittedRequest, num_new_tokens: int, delay_cache: bool, reserved_blocks: int | Sequence[int]
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
                manager.add_boundary(request_id, need)
        if not delay_cache:
            self._cache(state, need)
        state.capacity = min([len(m.tables[request_id]) * m.block_size for m in self.managers])
        state.next_drop = min([m.next_skip_change(total) for m in self._droppers], default=NEVER_SKIPS)
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
            blocks = manager.num_blocks_to_allocate(request_id, need, hit_blocks[g], total, force)
            predicted[manager.pool.index] += blocks
        free_before = self._fits(predicted, reserved_blocks)
        if free_before is None:
            return None

        state = AdmittedRequest(request, hit.shared_prefix_tokens if hit is not None else 0)
        self._admitted[request_id] = state
        self._admit(request_id, hit_blocks, num_local, num_external_tokens, partial)
        new_ids = tuple([*map(_BLOCK_ID, manager.allocate_new(request_id, need))] for manager in managers)
        self._record_allocation(predicted, free_before)
        if self.copy_now is not None and (num_external_tokens or partial):
            self.copy_now(self.take_tier_copies())

        if self._windowed:
            if state.shared_prefix:
                for manager in self._windowed:
                    manager.add_boundary(request_id, state.shared_prefix)
            if num_new_tokens > 1:
                for manager in self._windowed:
                    manager.add_boundary(request_id, need)
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
        host = self.host
        promoted: list[tuple[int, int, Block]] = []  # (group, table index, host block)
        if host is not None:
            hit_blocks, promoted = host.split_hit(self.managers, hit_blocks, total)
        for g, manager in enumerate(self.managers):  # phase 1
            manager.claim_hit(request_id, hit_blocks[g], total)
        if promoted:
            assert host is not None, "only a coordinator with a host tier promotes"
            host.promote_hit(self.managers, request_id, promoted, self.pins.pinned_on_device)
        for manager in self.managers:  # phase 2
            if num_external > 0 or (partial and isinstance(manager, MambaManager)):
                manager.allocate_external(request_id, num_local, num_external)

    def take_tier_copies(self) -> list[TierCopy]:
        """The host-tier copies queued since the last call, in the order they must run (before
        the next forward); empty without a host tier."""
        return self.host.take_copies() if self.host is not None else []

    def cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens`` (rounded down to the alignment),
        e.g. once a transfer into its blocks completed."""
        state = self._admitted.get(request.request_id)
        if state is not None:
            self._cache(state, num_tokens)

    def _cache(self, state: AdmittedRequest, num_tokens: int) -> None:
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

    # -- views: capacity (``self.capacity``, engine/kv_cache/capacity.py), block tables, events ----------
    @property
    def num_pools(self) -> int:
        return len(self.pools)

    @property
    def num_free_blocks(self) -> int:
        """Free (incl. pinned, demotable) blocks of the tightest pool (``PoolCapacity``)."""
        return self.capacity.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use in the tightest pool (``PoolCapacity``)."""
        return self.capacity.usage

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

    # -- events and invariants -------------------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """Drain the KV events of every pool and of the host tier since the last call (one
        sequence, in order)."""
        if self.host is not None:
            self.host.flush_events()
        return self.events.take()

    def check_invariants(self) -> None:
        """Raise KVCacheInvariantError if any structural invariant of the cache is broken
        (``engine.kv_cache.invariants`` lists them), the host tier's included."""
        leased = self.leases.references()
        check_coordinator(
            self.managers, self.group_pool, self.pools, self._admitted, self.pins, self._last_allocation, leased
        )
        if self.host is not None:
            check_host_tier(self.group_pool, self.pools, self.host, self.pins, leased)

    # -- read-only views for the router ---------------------------------------------------------------
    @property
    def event_seq(self) -> int:
        """Sequence number of the last KV event this worker emitted (0 before the first; the host
        tier's changes are numbered first)."""
        if self.host is not None:
            self.host.flush_events()
        return self.events.seq

    def snapshot(self) -> tuple[int, tuple[dict[bytes, int], ...], tuple[dict[bytes, int], ...]]:
        """``(event_seq, per-group {hash: pin level} of the device tier, the same of the host tier)``
        over all pools (no host tier: empty dicts): what a router resyncs from after a gap in the
        event stream. The dicts are fresh copies."""
        host = self.host
        if host is None:
            hosted: tuple[dict[bytes, int], ...] = tuple({} for _ in self.managers)
        else:
            host.flush_events()
            hosted = host.snapshot(len(self.managers), self.group_pool)
        return self.events.seq, tuple({h: block.tier for h, block in m.cached.items()} for m in self.managers), hosted

    def host_hit_tokens(self, hit: CacheHit) -> int:
        """Tokens of ``hit`` served from the host tier (``HostTier.hit_tokens``); 0 without one."""
        if self.host is None or not hit.num_tokens:
            return 0
        sizes = [m.block_size for m in self.managers]
        return HostTier.hit_tokens(hit.blocks, hit.num_tokens, sizes, self.hash_block_size)

    # -- explicit prefix pins (owned by ``self.pins``, engine/kv_cache/prefix_pins.py) ---------------------
    def pin_prefix(self, block_hashes: list[bytes], num_tokens: int, tier: PinTier = "device") -> int:
        """Pin, in every group, the blocks a hit at the prefix's end needs; returns the pinned
        length (the longest aligned cached hit <= num_tokens, over both tiers when there is a host
        tier; 0 if nothing is cached yet, or if a host-tier pin finds no room).

        ``tier="device"``: device blocks go to their pool's explicit tier, and host copies of the
        same (group, hash) to the host pool's; when the device pool must give such a block up
        (demotion under pressure) it is offloaded pinned, and a hit promotes it back and pins the
        device copy again. ``tier="host"`` (needs a host tier): the blocks are held pinned in the
        host tier only (device-only ones are copied there now; nothing on the device is pinned),
        so the pin costs no device memory and a hit promotes them. A host-tier pin is all or
        nothing: when the host pools' unpinned blocks cannot take the blocks it must copy, it pins
        nothing and returns 0 (docs/architecture.md, "The hybrid KV cache": pins in the host tier).

        Pins of one prefix (same hashes, ``num_tokens`` and ``tier``) are counted: the blocks stay
        pinned until as many ``unpin_prefix`` calls with the same arguments as there were pins.
        """
        return self.pins.pin(block_hashes, num_tokens, tier)

    def is_pinned(self, group: int, block_hash: bytes) -> bool:
        """Whether a prefix pin of either tier holds (group, hash) (the host tier pins it there)."""
        return self.pins.is_pinned(group, block_hash)

    def unpin_prefix(self, block_hashes: list[bytes], num_tokens: int, tier: PinTier = "device") -> bool:
        """Undo one ``pin_prefix(block_hashes, num_tokens, tier)``; the prefix's blocks are released
        with its last pin, and blocks other prefixes' pins need stay pinned. False if not pinned."""
        return self.pins.unpin(block_hashes, num_tokens, tier)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash and pin in every pool; refused (False) while any pool has a
        block in use or a hit lease is held. One ``AllBlocksCleared`` event covers all pools."""
        if self.leases or not all(pool.idle for pool in self.pools):
            return False
        for pool in self.pools:
            pool.clear_prefix_cache()
        if self.host is not None:
            self.host.clear()
        self.events.emit(AllBlocksCleared(self.events.next_seq()))
        self.pins.clear()
        return True

    # -- release: finished requests, left-behind window blocks, failed computes ---------------------------
    def discard_uncomputed(self, request_id: str, num_computed: int) -> None:
        """Take out of the prefix cache every block of the request holding positions at or past
        ``num_computed`` (their compute failed, so what ``allocate_slots`` registered for them
        was never written); hits and pins before that point stay. Call before ``free``."""
        state = self._admitted.get(request_id)
        if state is None:
            return
        stale = []
        for manager in self.managers:
            table = manager.tables.get(request_id, [])
            stale = [b for b in table[num_computed // manager.block_size :] if not b.is_null and not b.tier]
            manager.pool.evict(stale)
        state.cached_upto = min(state.cached_upto, num_computed)

    def remove_skipped_blocks(self, request_id: str, num_computed: int) -> None:
        """Release blocks no group needs any more once ``num_computed`` tokens are computed."""
        state = self._admitted.get(request_id)
        if state is None:
            return
        for manager in self._droppers:
            manager.remove_skipped_blocks(request_id, num_computed)
        state.removed_upto = max(state.removed_upto, num_computed)

    def free(self, request_id: str) -> None:
        """Release every block of the request, group by group, tail first. Idempotent.

        With retention on, the blocks a hit at the request's shared-prefix boundary needs (the
        prefix other requests share) go to the retained tier rather than the free queue.
        """
        state = self._admitted.pop(request_id, None)
        if state is None:
            return
        managers = self.managers
        if self._retain_shared_prefix and state.shared_prefix:
            boundary = state.shared_prefix
            if self._free_together:
                self._free_retaining_together(request_id, boundary)
                return
            for manager in managers:
                manager.free(request_id, manager.blocks_needed_at(boundary))
        elif len(managers) == 1 or not self._single_pool:
            for manager in managers:
                manager.free(request_id)
        else:
            # One pool: release every group's live blocks (each group's tail first) in one pass.
            # Across groups only the order of uncached blocks at the free queue's head differs
            # from group-by-group frees, which no hit can observe.
            blocks: list[Block] = []
            for manager in managers:
                blocks += manager.pop_live(request_id)
            self.pool.free_blocks(blocks)

    def _free_retaining_together(self, request_id: str, boundary: int) -> None:
        """``free`` with retention in one pool with no Mamba group and no retained-tier cap: what
        the groups' ``free(request_id, blocks_needed_at(boundary))`` calls would do, in as few
        pool calls as there are runs of released-to-free / retained blocks (group order, each
        group's tail first). Cached blocks reach the same queue positions, pinned ones their tiers
        in the same order, events come in the same order (no cap: no demotion in between); only
        uncached blocks at the free queue's head may come in another order, which no hit sees."""
        pool = self.pool
        run: list[Block] = []  # blocks for ``free_blocks``, in release order
        for manager in self.managers:
            item = manager.pop_release(request_id, boundary)
            if item is None:
                continue
            ordered, start, stop = item
            if start == stop:
                run += ordered
                continue
            if run:
                run += ordered[:start]
                pool.free_blocks(run, enforce=False)
            elif start:
                pool.free_blocks(ordered[:start], enforce=False)
            pool.free_retaining(ordered[start:stop])
            run = ordered[stop:]
        if run:
            pool.free_blocks(run, enforce=False)
