"""The host tier: cached blocks the device pools evicted, kept in host memory, per device pool.

A worker with ``kv_cache.offload`` on has, beside each device ``BlockPool``, a host pool of its
own size (``HostTier.pools[p]`` mirrors device pool ``p``: same page size, same groups). This
module decides which blocks move where; the copies themselves are the runner's
(``engine.host_kv.HostKVMemory``): the tier hands them out in order as ``TierCopy`` batches
(docs/architecture.md, "The hybrid KV cache": the host tier).

- **Offload.** When a device pool evicts a cached block (``BlockPool.get_new_blocks`` reuses it),
  its (group, hash) and contents go to the host pool: a host block is taken from the head of the
  host pool's free queue (its least recently used block, whose own entry is dropped) and a copy
  device -> host is queued. A hash the host tier holds already is only marked as just used.
- **Promote.** A hit may name host blocks (``HybridCoordinator.find_longest_cache_hit`` looks in
  both tiers, per group, with each group's own rule); admission claims the device hit blocks
  first, then gives every host block of the hit a fresh device block and queues a copy
  host -> device (``HostTier.promote_hit``). The host copy stays cached.

Copies must run in the order queued, and before the next forward reads or writes any block:
an offload reads a device block before its new owner writes it, a promote reads a host block
before a later offload reuses it. What the order must keep is only those dependencies, so the
queue coalesces: copies accumulate in a *phase*, one offload batch and one promote batch per
pool, whose offloads all run before its promotes; an offload joins the phase unless a promote
already in it reads the host block the offload writes, writes the device block it reads, or an
offload in it writes that host block too; a promote joins unless one in it writes the same device
block. Otherwise a new phase begins. An admission's eviction-then-promote pairs (the fresh
device block a promote fills is the one just offloaded) and a whole engine step's copies thus
become a few large batches rather than alternating one-block ones, whose per-call cost, not
their bytes, would set the copy time. The host pools reuse ``BlockPool``: a host block is free (no
hash) or cached, ref count 0, except while an admission promotes it (``lock`` / ``unlock``:
a locked block is out of the LRU queue, so no offload of that admission can take it).

- **Pins.** A (group, hash) some prefix pin holds (``is_pinned``, the coordinator's pin counts:
  docs/architecture.md, "The hybrid KV cache": pins in the host tier) sits in its host pool's
  explicit tier whenever the host tier has it: ``offload`` pins what it stores or refreshes,
  ``pin`` / ``release`` follow the coordinator's pins. Only unpinned host blocks are ever reused
  (the free queue's head); a pinned one leaves the tier only when its last pin is released (then
  it is an ordinary LRU block) or the cache is reset. A host tier full of pins takes no further
  block, pinned or not: the arriving block is dropped (``TierCounters.dropped``, and
  ``pins_dropped`` when it was pinned), so the pins already there stay whole.

Events (``engine.kv_cache.events``): with the worker's event log enabled, every hash that enters
a host pool is announced by ``BlockOffloaded`` and every hash that leaves one (its host block
reused by the LRU) by ``BlockDropped``, on the worker's one sequence. The tier notes them in
order as they happen (offloads come one block at a time, from inside a device pool's
allocation) and ``flush_events`` numbers them, one event per run of one kind, pool and group,
before anyone reads the log (``HybridCoordinator.take_events`` / ``snapshot``). The host maps
change only through the host events, so their order among themselves is the order of the changes.
Promotes change no host entry (the device announces ``BlockPromoted``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_cache.block_pool import TIER_EXPLICIT, Block, BlockPool
from engine.kv_cache.events import BlockDropped, BlockOffloaded, EventLog
from engine.kv_cache.manager_base import SingleTypeManager

#: host pools are numbered from here (``Block.pool`` of a host block: ``HOST_POOL_BASE + p``), so a
#: hit's blocks say which tier they are in
HOST_POOL_BASE = 1 << 16
#: what a device pool calls for each cached block it evicts: (device block id, group, hash)
Offload = Callable[[int, int, bytes], None]
#: whether some prefix pin holds (group, hash)
IsPinned = Callable[[int, bytes], bool]


def _never_pinned(group: int, block_hash: bytes) -> bool:
    return False


@dataclass(slots=True)
class TierCopy:
    """Copies of one direction between device pool ``pool`` and its host pool, to run in list
    order: ``to_host`` copies device block ``device_ids[i]`` into host block ``host_ids[i]``
    (offload), otherwise the host block into the device block (promote). Within one batch no
    target block repeats, so its copies may run in any order."""

    pool: int
    to_host: bool
    device_ids: list[int] = field(default_factory=list)
    host_ids: list[int] = field(default_factory=list)


@dataclass
class TierCounters:
    """Blocks offloaded (copied to the host), refreshed (already there), dropped (no host block
    free; ``pins_dropped`` of them pinned) and promoted (copied back), since the tier was built."""

    offloaded: int = 0
    refreshed: int = 0
    dropped: int = 0
    promoted: int = 0
    pins_dropped: int = 0


class HostTier:
    """One host ``BlockPool`` per device pool and the copies queued for the runner.

    Invariants (``engine.kv_cache.invariants.check_host_tier``): every host pool satisfies the
    pool invariants with no block referenced outside an admission; its hash maps hold only
    groups of the matching device pool; ``copies`` lists batches in the order they must run,
    each naming valid block ids of its pool and no target twice; a cached host block is in its
    pool's explicit tier iff ``is_pinned`` holds for its (group, hash).
    """

    def __init__(
        self,
        num_blocks: Sequence[int],
        num_groups: int,
        events: EventLog | None = None,
        is_pinned: IsPinned = _never_pinned,
    ):
        """``events``: the worker's event log (host events go there when it is enabled);
        ``is_pinned``: whether some prefix pin holds a (group, hash) (the coordinator's pin counts)."""
        self.pools = [
            BlockPool(n, num_groups, enable_caching=True, index=HOST_POOL_BASE + p) for p, n in enumerate(num_blocks)
        ]
        self.copies: list[TierCopy] = []
        # the phase being queued (see the module docstring): its batches by (pool, to_host), where
        # in ``copies`` it starts, how many offload batches it has (they precede its promotes),
        # and the (pool, block id) entries its copies touch: host blocks its promotes read and
        # its offloads write, device blocks its promotes write
        self._phase: dict[tuple[int, bool], TierCopy] = {}
        self._phase_start = 0
        self._phase_offloads = 0
        self._promote_reads: set[tuple[int, int]] = set()
        self._promote_writes: set[tuple[int, int]] = set()
        self._offload_writes: set[tuple[int, int]] = set()
        self.counters = TierCounters()
        self.log = events if events is not None and events.enabled else None
        # host entries changed since the last ``flush_events``, in order: (entered?, pool, group, hash)
        self._changes: list[tuple[bool, int, int, bytes]] = []
        self.is_pinned = is_pinned

    @staticmethod
    def is_host(block: Block) -> bool:
        """Whether a block of a hit lives in the host tier (else in a device pool)."""
        return block.pool >= HOST_POOL_BASE

    @staticmethod
    def hit_tokens(blocks: Sequence[Sequence[Block]], num_tokens: int, block_sizes: Sequence[int], unit: int) -> int:
        """Tokens of a hit (``blocks``: each group's, ``num_tokens`` long) served from the host tier
        (``host_hit_tokens``; ``block_sizes``: each group's block size); the rest are the device's."""
        is_host = HostTier.is_host
        found = [(i, block_sizes[g]) for g, group in enumerate(blocks) for i, b in enumerate(group) if is_host(b)]
        return host_hit_tokens(num_tokens, unit, found) if found else 0

    # -- offload ------------------------------------------------------------------------------------------
    def offload(self, pool: int, device_id: int, group: int, block_hash: bytes) -> None:
        """Device pool ``pool`` evicts its block ``device_id`` cached as (group, hash): keep a copy."""
        host = self.pools[pool]
        pinned = self.is_pinned(group, block_hash)
        existing = host.cached[group].get(block_hash)
        if existing is not None:
            if existing.ref_cnt == 0:  # the same contents: mark them just used
                host.touch((existing,))
                host.free_blocks([existing])
            if pinned:
                host.retain((existing,), TIER_EXPLICIT)
            self.counters.refreshed += 1
            return
        if host.free_queue.size == 0:  # every host block is pinned, or locked by the admission under way
            self.counters.dropped += 1
            self.counters.pins_dropped += pinned
            return
        if self.log is not None:
            victim: Block = host.free_queue.head.next  # type: ignore[assignment]  # size > 0: a real block
            if victim.block_hash is not None:
                self._changes.append((False, pool, victim.group, victim.block_hash))
            self._changes.append((True, pool, group, block_hash))
        block = host.get_new_blocks(1)[0]  # the least recently used unpinned host block (its entry dropped)
        host.cache_blocks(group, [block], [block_hash], 0, 1)
        host.free_blocks([block])  # cached: to the tail, the most recently used end
        if pinned:
            host.retain((block,), TIER_EXPLICIT)
        self._queue(pool, True, device_id, block.block_id)
        self.counters.offloaded += 1

    def offloader(self, pool: int) -> Offload:
        """The callable device pool ``pool`` calls for each cached block it evicts."""

        def offload(device_id: int, group: int, block_hash: bytes) -> None:
            self.offload(pool, device_id, group, block_hash)

        return offload

    # -- pins -------------------------------------------------------------------------------------------
    def pin(self, pool: int, group: int, hashes: Sequence[bytes]) -> None:
        """Move the host copies of these (group, hash) entries, where held, to the explicit tier."""
        host = self.pools[pool]
        table = host.cached[group]
        host.retain([block for block in map(table.get, hashes) if block is not None], TIER_EXPLICIT)

    def release(self, pool: int, group: int, hashes: Sequence[bytes]) -> None:
        """The last pin of these entries is gone: their host copies become ordinary LRU blocks."""
        host = self.pools[pool]
        table = host.cached[group]
        host.release_tier([block for block in map(table.get, hashes) if block is not None], TIER_EXPLICIT)

    def room(self, pool: int) -> int:
        """Host blocks an offload into ``pool``'s host pool may take now (unpinned, unlocked)."""
        return self.pools[pool].free_queue.size

    # -- promote ----------------------------------------------------------------------------------------
    def lock(self, blocks: list[Block]) -> None:
        """Take host blocks an admission promotes out of the LRU queue until ``unlock``."""
        for block in blocks:
            self.pools[block.pool - HOST_POOL_BASE].touch((block,))

    def unlock(self, blocks: list[Block]) -> None:
        """Return locked host blocks to their queue, as just used."""
        for block in blocks:
            self.pools[block.pool - HOST_POOL_BASE].free_blocks([block])

    def promote(self, host_block: Block, device_id: int) -> None:
        """Queue the copy of ``host_block`` into device block ``device_id`` (of the same pool)."""
        self._queue(host_block.pool - HOST_POOL_BASE, False, device_id, host_block.block_id)
        self.counters.promoted += 1

    # -- admission of a hit that names host blocks ---------------------------------------------------
    def split_hit(
        self, managers: Sequence[SingleTypeManager], hit_blocks: tuple[list[Block], ...], total: int
    ) -> tuple[tuple[list[Block], ...], list[tuple[int, int, Block]]]:
        """The hit's device part (host blocks replaced by the null block) and, per host block a
        claim keeps (at or past the group's skipped blocks), its (group, table index, block)."""
        promoted: list[tuple[int, int, Block]] = []
        device: list[list[Block]] = []
        for g, blocks in enumerate(hit_blocks):
            if not any(map(HostTier.is_host, blocks)):
                device.append(blocks)
                continue
            manager = managers[g]
            skipped = manager.skipped_blocks(total)
            mine = list(blocks)
            for i, block in enumerate(blocks):
                if HostTier.is_host(block):
                    mine[i] = manager.null
                    if i >= skipped:
                        promoted.append((g, i, block))
            device.append(mine)
        return tuple(device), promoted

    def promote_hit(
        self,
        managers: Sequence[SingleTypeManager],
        request_id: str,
        promoted: list[tuple[int, int, Block]],
        pinned_on_device: IsPinned,
    ) -> None:
        """Between the two phases of an admission: a fresh device block for each host block of
        the hit, cached under its hash at once (its copy is queued before any forward can read
        it) and pinned on the device again where a device-tier pin holds it. The host blocks stay
        locked meanwhile, so the offloads these allocations cause cannot reuse them."""
        locked = [block for _, _, block in promoted]
        self.lock(locked)
        for g, index, block in promoted:
            manager = managers[g]
            fresh = manager.pool.get_new_blocks(1)
            self.promote(block, fresh[0].block_id)
            manager.place(request_id, index, fresh[0])
            assert block.block_hash is not None, "host blocks of a hit come from the host maps"
            manager.pool.cache_blocks(g, fresh, [block.block_hash], 0, 1, promoted=True)
            if pinned_on_device(g, block.block_hash):
                manager.pool.retain(fresh, TIER_EXPLICIT)
        self.unlock(locked)

    def _queue(self, pool: int, to_host: bool, device_id: int, host_id: int) -> None:
        """Add one copy to the current phase, or begin a new phase where running it with the
        phase's batches (offloads first) would not keep what the queue order means."""
        device, hosted = (pool, device_id), (pool, host_id)
        if to_host:
            if hosted in self._promote_reads or device in self._promote_writes or hosted in self._offload_writes:
                self._new_phase()
            self._offload_writes.add(hosted)
        else:
            if device in self._promote_writes:
                self._new_phase()
            self._promote_reads.add(hosted)
            self._promote_writes.add(device)
        batch = self._phase.get((pool, to_host))
        if batch is None:
            batch = self._phase[(pool, to_host)] = TierCopy(pool, to_host)
            if to_host:
                self.copies.insert(self._phase_start + self._phase_offloads, batch)
                self._phase_offloads += 1
            else:
                self.copies.append(batch)
        batch.device_ids.append(device_id)
        batch.host_ids.append(host_id)

    def _new_phase(self) -> None:
        self._phase = {}
        self._phase_start = len(self.copies)
        self._phase_offloads = 0
        self._promote_reads = set()
        self._promote_writes = set()
        self._offload_writes = set()

    def take_copies(self) -> list[TierCopy]:
        """The copies queued since the last call, in the order they must run."""
        copies, self.copies = self.copies, []
        self._new_phase()
        return copies

    # -- events ----------------------------------------------------------------------------------------
    def flush_events(self) -> None:
        """Number the host entries' changes noted since the last call and put them on the log:
        one ``BlockOffloaded`` / ``BlockDropped`` per run of one kind, pool and group, in order."""
        changes = self._changes
        log = self.log
        if not changes or log is None:
            return
        self._changes = []
        run: list[bytes] = []
        key = changes[0][:3]
        for entered, pool, group, block_hash in changes:
            if (entered, pool, group) != key:
                log.emit((BlockOffloaded if key[0] else BlockDropped)(log.next_seq(), key[2], tuple(run), key[1]))
                run = []
                key = (entered, pool, group)
            run.append(block_hash)
        log.emit((BlockOffloaded if key[0] else BlockDropped)(log.next_seq(), key[2], tuple(run), key[1]))

    # -- views and maintenance -----------------------------------------------------------------------------
    def num_cached_blocks(self, pool: int) -> int:
        return sum(len(table) for table in self.pools[pool].cached)

    def snapshot(self, num_groups: int, group_pool: Sequence[int]) -> tuple[dict[bytes, int], ...]:
        """Per group, every hash the host tier holds and its pin level (fresh dicts)."""
        return tuple(
            {h: block.tier for h, block in self.pools[group_pool[g]].cached[g].items()} for g in range(num_groups)
        )

    def clear(self) -> None:
        """Forget every host entry (the prefix cache was reset: the caller announces it, so the
        changes not yet flushed are moot); queued copies still run."""
        for pool in self.pools:
            pool.clear_prefix_cache()
        self._changes = []


def host_hit_tokens(num_tokens: int, unit: int, host_blocks: Iterable[tuple[int, int]]) -> int:
    """The tokens of a hit of ``num_tokens`` served from the host tier: the positions some group's
    host block of the hit covers (``host_blocks``: (table index, block size) of each; block sizes
    are multiples of ``unit``, the hash granularity). The rest of the hit is the device's. One
    rule for the coordinator's count and the router's prediction."""
    covered = bytearray(num_tokens // unit)
    for index, block_size in host_blocks:
        per = block_size // unit
        covered[index * per : (index + 1) * per] = b"\x01" * per
    return covered.count(1) * unit
