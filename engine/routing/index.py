"""The global prefix index: which worker caches which block, per KV-cache group, fed by KV events.

Per worker and group the index keeps the set of cached block hashes and their pin level (0 none,
1 retained, 2 explicit), exactly as the worker's block pool announced them. Per group it also
keeps an inverted map ``hash -> bitmask of workers`` so one walk over a request's hashes answers
for every worker at once.

Prediction applies the worker coordinator's own hit rules (``HitRules``): the hit on worker w is
the longest aligned length L <= max_length at which *every* group can serve a hit, where a group
serves L iff the blocks its manager's ``blocks_needed_at(L)`` names are cached (full attention:
the whole prefix; sliding window: the ``blocks_for_hit`` blocks ending at L; Mamba: the state
block ending at L). ``HybridCoordinator.find_longest_cache_hit`` computes that length as a fixed
point over groups; the index gets the same answer faster:

1. walk the full-attention group's hashes once with worker bitmasks: each worker's contiguous
   depth (cost O(prefix blocks), independent of how many prefixes are cached);
2. per distinct depth L, AND the bitmasks of the blocks the other groups need at L
   (``blocks_needed_at``): workers that pass have hit L;
3. a worker that fails at L (a window or a Mamba state is missing at the full-attention depth) is
   answered by the coordinator's own fixed point, run on a shadow coordinator whose managers look
   at this worker's hash sets (``HitRules.longest_hit``). That path is rare and bounded by L.

Event stream discipline: a worker's events carry consecutive sequence numbers. A gap marks the
worker stale: later events are buffered and the caller is asked (``needs_resync``) for a
``WorkerSnapshot`` of the worker's pool; applying it replays the buffered events newer than the
snapshot. A stale worker keeps predicting from its last known state.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from engine.kv_cache.block_queue import PIN_EXPLICIT, PIN_NONE, PIN_RETAINED
from engine.kv_cache.coordinator import HybridCoordinator
from engine.kv_cache.events import AllBlocksCleared, BlockPinned, BlockRemoved, BlockStored, BlockUnpinned, KVEvent
from engine.kv_cache.managers import FullAttentionManager, MambaManager, SingleTypeManager
from engine.kv_cache.spec import KVCacheGroup

WorkerId = Hashable
GroupHash = tuple[int, bytes]

#: events buffered for a stale worker before the index gives up on replaying them (then it asks
#: for another snapshot once the current one is applied).
MAX_BUFFERED_EVENTS = 200_000


@dataclass(frozen=True)
class WorkerSnapshot:
    """A worker's prefix-cache state: per group, every cached hash and its pin level, as of the
    pool's event sequence number ``seq`` (events with seq <= ``seq`` are already reflected)."""

    seq: int
    groups: tuple[dict[bytes, int], ...]


def snapshot_coordinator(coord: HybridCoordinator) -> WorkerSnapshot:
    """The snapshot a worker returns when the router asks for a resync (runs on the worker)."""
    pool = coord.pool
    # The pool exposes no public event counter; _seq is the number of the last event it emitted.
    seq: int = pool._seq  # noqa: SLF001
    return WorkerSnapshot(seq, tuple({h: block.pin for h, block in table.items()} for table in pool.cached))


class HitRules:
    """The coordinator's hit rules over arbitrary per-group hash sets.

    Holds a 2-block shadow ``HybridCoordinator`` with the router's groups: its managers give the
    per-type rules (``blocks_needed_at``, views at each group's granularity) and, for the slow path,
    its ``find_longest_cache_hit`` runs unchanged after each manager's ``cached`` map is pointed at
    the worker's hash set (the manager code only reads ``cached.get(h)`` / ``cached[h]``).
    """

    def __init__(self, groups: Sequence[KVCacheGroup]):
        self.groups = list(groups)
        self._shadow = HybridCoordinator(self.groups, num_blocks=2)
        self.managers: list[SingleTypeManager] = self._shadow.managers
        self.alignment = self._shadow.alignment
        self.hash_block_size = self._shadow.hash_block_size
        self.full_groups = [g for g, m in enumerate(self.managers) if isinstance(m, FullAttentionManager)]
        self.mamba_groups = {g for g, m in enumerate(self.managers) if isinstance(m, MambaManager)}
        self.block_sizes = [m.block_size for m in self.managers]

    def views(self, hashes: Sequence[bytes]) -> list[list[bytes]]:
        """The request's hashes at each group's granularity."""
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        return [m.view(hashes) for m in self.managers]

    def longest_hit(
        self, tables: Sequence[Mapping[bytes, object]], hashes: Sequence[bytes], max_length: int, skip_mamba: bool
    ) -> int:
        """The coordinator's own fixed point, evaluated on these per-group hash sets."""
        for manager, table in zip(self.managers, tables):
            manager.cached = table  # type: ignore[assignment]
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        return self._shadow.find_longest_cache_hit(hashes, max_length, skip_mamba).num_tokens

    def needed(self, hashes: Sequence[bytes], length: int, skip_mamba: bool = False) -> list[GroupHash]:
        """(group, hash) of every block a hit at ``length`` needs (what ``pin_prefix`` pins)."""
        views = self.views(hashes)
        out: list[GroupHash] = []
        for g, manager in enumerate(self.managers):
            if skip_mamba and g in self.mamba_groups:
                continue
            view = views[g]
            out.extend((g, view[i]) for i in manager.blocks_needed_at(length))
        return out

    def aligned(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self.alignment


class _Worker:
    __slots__ = ("worker", "slot", "bit", "tables", "last_seq", "stale", "buffer", "overflowed")

    def __init__(self, worker: WorkerId, slot: int, num_groups: int):
        self.worker = worker
        self.slot = slot
        self.bit = 1 << slot
        self.tables: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self.last_seq = 0
        self.stale = False
        self.buffer: list[KVEvent] = []
        self.overflowed = False


@dataclass
class EventOutcome:
    """What applying a batch of events found: whether the worker needs a resync (a gap was seen
    for the first time in this batch), and which watched (group, hash) keys lost their explicit pin
    or their cache entry (``cleared``: the worker's whole cache was reset)."""

    needs_resync: bool = False
    lost: list[GroupHash] | None = None
    cleared: bool = False


class PrefixIndex:
    """Per worker, per group: cached hashes and pin levels; per group: hash -> worker bitmask."""

    def __init__(self, groups: Sequence[KVCacheGroup]):
        self.rules = HitRules(groups)
        self.num_groups = len(self.rules.groups)
        self._workers: dict[WorkerId, _Worker] = {}
        self._by_slot: list[_Worker | None] = []
        self._free_slots: list[int] = []
        self._owners: list[dict[bytes, int]] = [{} for _ in range(self.num_groups)]
        self.all_mask = 0

    # -- membership ---------------------------------------------------------------------------------
    @property
    def workers(self) -> list[WorkerId]:
        return list(self._workers)

    def __contains__(self, worker: object) -> bool:
        return worker in self._workers

    def add_worker(self, worker: WorkerId, snapshot: WorkerSnapshot | None = None) -> None:
        """Start tracking ``worker`` (empty, expecting its first event to be seq 1, or from a snapshot)."""
        if worker in self._workers:
            raise ValueError(f"worker {worker!r} is already in the prefix index")
        slot = self._free_slots.pop() if self._free_slots else len(self._by_slot)
        state = _Worker(worker, slot, self.num_groups)
        if slot == len(self._by_slot):
            self._by_slot.append(state)
        else:
            self._by_slot[slot] = state
        self._workers[worker] = state
        self.all_mask |= state.bit
        if snapshot is not None:
            self.apply_snapshot(worker, snapshot)

    def remove_worker(self, worker: WorkerId) -> None:
        state = self._workers.pop(worker, None)
        if state is None:
            return
        self._clear(state)
        self.all_mask &= ~state.bit
        self._by_slot[state.slot] = None
        self._free_slots.append(state.slot)

    def slot_of(self, worker: WorkerId) -> int:
        return self._workers[worker].slot

    def workers_in(self, mask: int) -> Iterator[WorkerId]:
        by_slot = self._by_slot
        while mask:
            low = mask & -mask
            state = by_slot[low.bit_length() - 1]
            if state is not None:
                yield state.worker
            mask ^= low

    # -- queries ------------------------------------------------------------------------------------
    def is_stale(self, worker: WorkerId) -> bool:
        return self._workers[worker].stale

    def last_seq(self, worker: WorkerId) -> int:
        return self._workers[worker].last_seq

    def cached(self, worker: WorkerId, group: int, block_hash: bytes) -> bool:
        return block_hash in self._workers[worker].tables[group]

    def pin_level(self, worker: WorkerId, group: int, block_hash: bytes) -> int | None:
        """The announced pin level of a cached hash (None when not cached)."""
        return self._workers[worker].tables[group].get(block_hash)

    def tables(self, worker: WorkerId) -> list[dict[bytes, int]]:
        """The worker's per-group hash -> pin level maps (read-only view for tests and tools)."""
        return self._workers[worker].tables

    def num_cached(self, worker: WorkerId) -> int:
        return sum(len(t) for t in self._workers[worker].tables)

    def hit(self, worker: WorkerId, hashes: Sequence[bytes], max_length: int, skip_mamba: bool = False) -> int:
        """The predicted hit on one worker by the coordinator's own fixed point (reference path)."""
        return self.rules.longest_hit(self._workers[worker].tables, hashes, max_length, skip_mamba)

    def predict(
        self, hashes: Sequence[bytes], max_length: int, skip_mamba: bool = False, mask: int | None = None
    ) -> dict[WorkerId, int]:
        """Predicted hit length on every worker with a non-zero hit (``mask``: only these slots).

        ``max_length`` is what the coordinator is asked: ``num_tokens - 1`` for a new request.
        """
        rules = self.rules
        alive = self.all_mask if mask is None else mask & self.all_mask
        cap = rules.aligned(max_length) if max_length > 0 else 0
        if cap <= 0 or not alive:
            return {}
        views = rules.views(hashes)
        hits: dict[WorkerId, int] = {}
        checks = [g for g in range(self.num_groups) if not (skip_mamba and g in rules.mamba_groups)]
        if rules.full_groups:
            g0 = rules.full_groups[0]
            checks.remove(g0)
            bs0 = rules.block_sizes[g0]
            stops = _walk(views[g0], min(cap // bs0, len(views[g0])), self._owners[g0], alive)
            for nblocks, workers in reversed(stops):
                length = rules.aligned(nblocks * bs0)
                if length <= 0:
                    continue
                valid = self._serving(workers, views, checks, length)
                for worker in self.workers_in(valid):
                    hits[worker] = length
                for worker in self.workers_in(workers & ~valid):
                    found = self.hit(worker, hashes, length, skip_mamba)
                    if found:
                        hits[worker] = found
            return hits
        # No full-attention group: candidates hold at least one of the request's blocks in every group.
        for g in checks:
            union = 0
            owners = self._owners[g]
            for block_hash in views[g][: cap // rules.block_sizes[g]]:
                union |= owners.get(block_hash, 0)
            alive &= union
        for worker in self.workers_in(alive):
            found = self.hit(worker, hashes, cap, skip_mamba)
            if found:
                hits[worker] = found
        return hits

    def _serving(self, workers: int, views: list[list[bytes]], checks: list[int], length: int) -> int:
        """The workers (bitmask) among ``workers`` for which every group in ``checks`` has the
        blocks ``blocks_needed_at(length)`` cached."""
        managers = self.rules.managers
        for g in checks:
            owners = self._owners[g]
            view = views[g]
            for i in managers[g].blocks_needed_at(length):
                workers &= owners.get(view[i], 0)
                if not workers:
                    return 0
        return workers

    # -- events -------------------------------------------------------------------------------------
    def apply_events(
        self, worker: WorkerId, events: Iterable[KVEvent], watched: Mapping[GroupHash, object] | None = None
    ) -> EventOutcome:
        """Apply a worker's events in order; duplicates (seq <= last) are ignored, a gap starts a
        resync. ``watched`` keys that lose their explicit pin or their entry are reported."""
        state = self._workers.get(worker)
        outcome = EventOutcome()
        if state is None:
            return outcome
        lost: list[GroupHash] | None = [] if watched else None
        for event in events:
            if event.seq <= state.last_seq:
                continue
            if state.stale:
                self._buffer(state, event)
                continue
            if event.seq != state.last_seq + 1:
                state.stale = True
                outcome.needs_resync = True
                self._buffer(state, event)
                continue
            if self._apply(state, event, watched, lost):
                outcome.cleared = True
        if lost:
            outcome.lost = lost
        return outcome

    def apply_snapshot(self, worker: WorkerId, snapshot: WorkerSnapshot) -> EventOutcome:
        """Replace the worker's state by ``snapshot`` and replay buffered newer events. The
        outcome asks for another resync if the buffer does not continue the snapshot."""
        state = self._workers[worker]
        if len(snapshot.groups) != self.num_groups:
            raise ValueError(f"snapshot of {worker!r} has {len(snapshot.groups)} groups, the index {self.num_groups}")
        self._clear(state)
        for g, table in enumerate(snapshot.groups):
            owners = self._owners[g]
            bit = state.bit
            mine = state.tables[g]
            for block_hash, level in table.items():
                mine[block_hash] = level
                owners[block_hash] = owners.get(block_hash, 0) | bit
        state.last_seq = snapshot.seq
        buffered, state.buffer = state.buffer, []
        overflowed, state.overflowed = state.overflowed, False
        state.stale = False
        outcome = self.apply_events(worker, sorted(buffered, key=lambda e: e.seq))
        if overflowed and not state.stale:
            state.stale = True  # events were dropped after the buffer: the replay may be incomplete
            outcome.needs_resync = True
        return outcome

    def _buffer(self, state: _Worker, event: KVEvent) -> None:
        if len(state.buffer) < MAX_BUFFERED_EVENTS:
            state.buffer.append(event)
        else:
            state.overflowed = True

    def _apply(
        self,
        state: _Worker,
        event: KVEvent,
        watched: Mapping[GroupHash, object] | None,
        lost: list[GroupHash] | None,
    ) -> bool:
        state.last_seq = event.seq
        bit = state.bit
        if isinstance(event, BlockStored):
            table = state.tables[event.group]
            owners = self._owners[event.group]
            for block_hash in event.block_hashes:
                if block_hash not in table:
                    table[block_hash] = PIN_NONE
                    owners[block_hash] = owners.get(block_hash, 0) | bit
        elif isinstance(event, BlockRemoved):
            g = event.group
            table = state.tables[g]
            owners = self._owners[g]
            for block_hash in event.block_hashes:
                if table.pop(block_hash, None) is None:
                    continue
                rest = owners.get(block_hash, 0) & ~bit
                if rest:
                    owners[block_hash] = rest
                else:
                    owners.pop(block_hash, None)
                if lost is not None and (g, block_hash) in watched:  # type: ignore[operator]
                    lost.append((g, block_hash))
        elif isinstance(event, BlockPinned):
            table = state.tables[event.group]
            level = PIN_EXPLICIT if event.explicit else PIN_RETAINED
            for block_hash in event.block_hashes:
                if table.get(block_hash, level) < level:
                    table[block_hash] = level
        elif isinstance(event, BlockUnpinned):
            g = event.group
            table = state.tables[g]
            for block_hash in event.block_hashes:
                if block_hash in table:
                    table[block_hash] = PIN_NONE
                    if lost is not None and (g, block_hash) in watched:  # type: ignore[operator]
                        lost.append((g, block_hash))
        elif isinstance(event, AllBlocksCleared):
            self._clear(state)
            state.last_seq = event.seq
            return True
        return False

    def _clear(self, state: _Worker) -> None:
        keep = ~state.bit
        for g, table in enumerate(state.tables):
            owners = self._owners[g]
            for block_hash in table:
                rest = owners.get(block_hash, 0) & keep
                if rest:
                    owners[block_hash] = rest
                else:
                    owners.pop(block_hash, None)
            table.clear()


def _walk(view: Sequence[bytes], limit: int, owners: Mapping[bytes, int], alive: int) -> list[tuple[int, int]]:
    """Contiguous-prefix depths of a downward-closed (full-attention) group: ``(n, mask)`` pairs,
    ascending in n, where ``mask`` holds the workers whose cached run of ``view`` is exactly ``n``
    blocks (n >= 1, capped at ``limit``)."""
    stops: list[tuple[int, int]] = []
    get = owners.get
    i = 0
    while i < limit:
        here = alive & get(view[i], 0)
        if here != alive:
            if i:
                stops.append((i, alive & ~here))
            alive = here
            if not alive:
                return stops
        i += 1
    if limit:
        stops.append((limit, alive))
    return stops
