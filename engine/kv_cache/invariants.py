"""Structural invariants of a ``HybridCoordinator`` and its block pools, checked by tests and
fuzzers after every operation, pool by pool.

Per group and request: a table holds only its group's pool's blocks (a block never moves between
pools), each live block once; outside Mamba groups null slots form a prefix of the table; a
Mamba table's live slots are exactly its recorded live states (at most 2); a sliding-window table
has no live block before the window of its last ``remove_skipped_blocks``. Per pool: ref counts
equal table references; a block is linked in exactly one queue (the one of its pin level) iff
unreferenced, and its ``prev``/``next`` are None iff it is linked nowhere; the null block is never
queued, hashed or counted; free + pinned + in use == num_blocks - 1; hash maps hold only blocks
of groups drawing from the pool, under their own hash; the retained tier is within its budget;
the last allocation took exactly the predicted number of blocks from every pool; a block in a
device pool's explicit tier is held by a device-tier prefix pin.

The host tier (``check_host_tier``), per host pool: the same pool invariants with no block
referenced (host blocks are locked only inside an admission), hash maps only of the groups of the
matching device pool; a cached host block is in the explicit tier exactly while a prefix pin of
either tier holds its (group, hash), and none is in the retained tier; the queued copies name
blocks of their pools, one direction per batch, no target twice in a batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from engine.kv_cache.attention_managers import SlidingWindowManager
from engine.kv_cache.block_pool import TIER_EXPLICIT, TIER_RETAINED, BlockPool
from engine.kv_cache.coordinator_types import AdmittedRequest
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.manager_base import SingleTypeManager
from engine.kv_cache.prefix_pins import PrefixPins


class KVCacheInvariantError(AssertionError):
    """An internal invariant of the KV cache does not hold (a bug, never bad user input)."""


def check_coordinator(
    managers: Sequence[SingleTypeManager],
    group_pool: Sequence[int],
    pools: Sequence[BlockPool],
    admitted_requests: Mapping[str, AdmittedRequest],
    pins: PrefixPins,
    last_allocation: Sequence[tuple[int, int]],
    leased: Counter[tuple[int, int]] | None = None,
) -> None:
    """Raise KVCacheInvariantError if any structural invariant of a coordinator (its managers,
    pools, admitted requests, prefix pins and last allocation) is broken. ``leased``: references
    held outside block tables by hit leases (``HitLeases.references``), by (``Block.pool``, id)."""

    def fail(message: str) -> None:
        raise KVCacheInvariantError(message)

    refs: Counter[tuple[int, int]] = Counter()  # (pool, block id) -> table references
    owner_group: dict[tuple[int, int], int] = {}
    position: dict[tuple[int, int], int] = {}
    admitted = set(admitted_requests)
    for g, manager in enumerate(managers):
        p = group_pool[g]
        pool = pools[p]
        if manager.pool is not pool:
            fail(f"group {g} draws from pool {manager.pool.index}, its KVCacheGroup.pool is {p}")
        null = pool.null_block
        if set(manager.tables) != admitted or set(manager.num_cached) != admitted:
            fail(f"group {g}: tables for {sorted(manager.tables)} but admitted {sorted(admitted)}")
        for request_id, table in manager.tables.items():
            request = admitted_requests[request_id].request
            view = manager.view(request.block_hashes)
            seen: set[int] = set()
            live = 0
            for i, block in enumerate(table):
                if block is null:
                    continue
                bid = block.block_id
                if block.pool != p or not 0 <= bid < pool.num_blocks or pool.blocks[bid] is not block:
                    fail(f"group {g} {request_id!r} index {i}: {block!r} is not a block of pool {p}")
                if block.is_null:
                    fail(f"group {g} {request_id!r} index {i}: another pool's null block")
                live += 1
                if bid in seen:
                    fail(f"block {bid} twice in {request_id!r} group {g}")
                seen.add(bid)
                key = (p, bid)
                refs[key] += 1
                if owner_group.setdefault(key, g) != g:
                    fail(f"block {bid} of pool {p} in groups {owner_group[key]} and {g}")
                first = position.setdefault(key, i)
                if first != i:
                    fail(f"block {bid} at indices {first} and {i} in group {g}")
                if block.block_hash is not None:
                    if block.group != g:
                        fail(f"block {bid} cached for group {block.group} but held by group {g}")
                    if i < len(view) and view[i] != block.block_hash and i < manager.num_cached[request_id]:
                        fail(f"block {bid} at index {i} of {request_id!r} carries another prefix's hash")
            if isinstance(manager, SlidingWindowManager):
                upto = admitted_requests[request_id].removed_upto
                first_live = manager.skipped_blocks(upto)
                if any(b is not null for b in table[:first_live]):
                    fail(f"group {g} {request_id!r}: live block before the window ({first_live})")
            if isinstance(manager, MambaManager):
                if live > 2:
                    fail(f"group {g} {request_id!r}: {live} live Mamba state blocks")
                if sorted(i for i, b in enumerate(table) if b is not null) != manager.live.get(request_id, []):
                    fail(f"group {g} {request_id!r}: live state indices disagree with the table")
            elif live != len(table) - next((i for i, b in enumerate(table) if b is not null), len(table)):
                fail(f"group {g} {request_id!r}: a null slot after a live block (nulls must be a prefix)")
    unshared_hashless = [key for key, n in refs.items() if n > 1 and pools[key[0]].blocks[key[1]].block_hash is None]
    if unshared_hashless:
        fail(f"blocks (pool, id) without a hash held by several requests: {unshared_hashless[:5]}")
    if leased:
        refs.update({key: n for key, n in leased.items() if key[0] < len(pools)})
    for pool in pools:
        _check_pool(group_pool, pool, pool.index, refs, fail)
        for block in pool.blocks:
            if block.tier == TIER_EXPLICIT and (block.group, block.block_hash) not in pins.device:
                fail(f"pool {pool.index}: {block!r} is explicitly pinned but no device-tier prefix pin holds it")
    for p, (predicted, taken) in enumerate(last_allocation):
        if predicted != taken:
            fail(f"last allocation predicted {predicted} blocks of pool {p} but took {taken}")


def check_host_tier(
    group_pool: Sequence[int],
    pools: Sequence[BlockPool],
    host: HostTier,
    pins: PrefixPins,
    leased: Counter[tuple[int, int]] | None = None,
) -> None:
    """Raise KVCacheInvariantError if an invariant of a coordinator's host tier is broken
    (``leased``: as for ``check_coordinator``; a host block is referenced only by leases)."""

    def fail(message: str) -> None:
        raise KVCacheInvariantError(message)

    if len(host.pools) != len(pools):
        fail(f"host tier: {len(host.pools)} host pools for {len(pools)} device pools")
    for p, pool in enumerate(host.pools):
        locked = Counter({key: n for key, n in (leased or {}).items() if key[0] == pool.index})
        _check_pool(group_pool, pool, p, locked, fail)
        if pool.retained.size:
            fail(f"host pool {p}: {pool.retained.size} blocks in the retained tier (host blocks are pinned or not)")
        for table in pool.cached:
            for block_hash, block in table.items():
                if (block.tier == TIER_EXPLICIT) != pins.is_pinned(block.group, block_hash):
                    fail(
                        f"host pool {p}: {block!r} pinned={block.tier == TIER_EXPLICIT} but pinned by a "
                        f"prefix pin={pins.is_pinned(block.group, block_hash)}"
                    )
    for copy in host.copies:
        if not 0 <= copy.pool < len(pools) or len(copy.device_ids) != len(copy.host_ids) or not copy.host_ids:
            fail(f"host tier: malformed copy batch {copy}")
        device, hosted = pools[copy.pool], host.pools[copy.pool]
        if not all(0 < d < device.num_blocks for d in copy.device_ids):
            fail(f"host tier: copy batch names device blocks outside pool {copy.pool}: {copy.device_ids}")
        if not all(0 < h < hosted.num_blocks for h in copy.host_ids):
            fail(f"host tier: copy batch names host blocks outside host pool {copy.pool}: {copy.host_ids}")
        targets = copy.host_ids if copy.to_host else copy.device_ids
        if len(set(targets)) != len(targets):
            fail(f"host tier: a copy batch writes one block twice: {copy}")


def _check_pool(
    group_pool: Sequence[int],
    pool: BlockPool,
    device_pool: int,
    refs: Counter[tuple[int, int]],
    fail: Callable[[str], None],
) -> None:
    """Queues, ref counts, conservation and hash maps of one pool (a device pool, or the host
    pool of device pool ``device_pool``: its groups are that device pool's)."""
    p = pool.index
    null = pool.null_block
    queues = {"free": pool.free_queue, "retained": pool.retained, "explicit": pool.explicit}
    queued: set[int] = set()
    for name, queue in queues.items():
        count = 0
        prev = queue.head
        expected_pin = {"free": 0, "retained": TIER_RETAINED, "explicit": TIER_EXPLICIT}[name]
        for block in queue:
            count += 1
            if block.prev is not prev:
                fail(f"pool {p}: {name} queue links broken at block {block.block_id}")
            if block.block_id in queued:
                fail(f"pool {p}: block {block.block_id} queued twice")
            if block.pool != p:
                fail(f"pool {p}: {block!r} of another pool in its {name} queue")
            queued.add(block.block_id)
            if block.tier != expected_pin:
                fail(f"pool {p}: block {block.block_id} with pin {block.tier} in the {name} queue")
            prev = block
        if count != queue.size:
            fail(f"pool {p}: {name} queue size {queue.size} but {count} linked")
    in_use = 0
    for bid, block in enumerate(pool.blocks):
        if block.block_id != bid or block.pool != p:
            fail(f"pool {p}: slot {bid} holds {block!r}")
        if block.is_null:
            if block.prev is not None or block.block_hash is not None or block is not null or block.ref_cnt:
                fail(f"pool {p}: null block queued, hashed or counted (ref_cnt {block.ref_cnt})")
            continue
        n = refs.get((p, bid), 0)
        if block.ref_cnt != n:
            fail(f"pool {p}: block {bid} ref_cnt {block.ref_cnt} but {n} table references")
        if block.ref_cnt > 0:
            in_use += 1
        in_queue = bid in queued
        if in_queue != (block.ref_cnt == 0):
            fail(f"pool {p}: block {bid} ref_cnt {block.ref_cnt} but queued={in_queue}")
        if (block.prev is None) == in_queue or (block.next is None) == in_queue:
            fail(f"pool {p}: block {bid} links disagree with the queues (prev/next None iff unlinked)")
        if block.block_hash is not None:
            if group_pool[block.group] != device_pool:
                fail(f"pool {p}: block {bid} cached for group {block.group}, which draws from another pool")
            if pool.cached[block.group].get(block.block_hash) is not block:
                fail(f"pool {p}: block {bid} carries a hash that does not map to it")
    if len(queued) + in_use != pool.num_blocks - 1:
        fail(f"pool {p}: conservation: {len(queued)} queued + {in_use} in use != {pool.num_blocks - 1}")
    for g, table in enumerate(pool.cached):
        if table and group_pool[g] != device_pool:
            fail(f"pool {p}: hash map of group {g}, which draws from pool {group_pool[g]}, is not empty")
        for block_hash, block in table.items():
            if block.block_hash != block_hash or block.group != g or block.is_null or block.pool != p:
                fail(f"pool {p}: hash map entry of group {g} points at {block!r}")
    if pool.retain_budget is not None and pool.retained.size > pool.retain_budget:
        fail(f"pool {p}: retained tier holds {pool.retained.size} > budget {pool.retain_budget}")
