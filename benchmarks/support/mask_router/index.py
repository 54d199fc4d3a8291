"""The global prefix index: which worker caches which block, per KV-cache group, fed by KV events.

Per worker and group the index keeps the set of cached block hashes and their pin level (0 none,
1 retained, 2 explicit), exactly as the worker's block pool announced them. Per group it also
keeps an inverted map ``hash -> bitmask of workers`` so one walk over a request's hashes answers
for every worker at once.

Prediction applies the worker coordinator's own hit rules (``HitRules``). Every group's manager
says which blocks a hit at length L needs (``blocks_needed_at(L)``: the whole prefix for full
attention, the ``blocks_for_hit`` blocks ending at L for a sliding window, the state block ending at
L for Mamba); a group serves L iff those blocks are cached. ``find_longest_cache_hit`` returns the
longest aligned L <= max_length that every group serves (each group's own search returns the
longest length <= its input that it serves, so the coordinator's fixed point over groups stops
exactly there). The index computes the same length for all workers at once:

1. walk the full-attention group's hashes once with worker bitmasks: each worker's contiguous
   depth D (cost O(prefix blocks), independent of how many prefixes are cached);
2. per distinct depth D, AND the bitmasks of the blocks the other groups need at D: the workers
   that pass hit exactly D (the common case);
3. the workers that fail (a window or a Mamba state is missing at D, e.g. a group lost blocks)
   are resolved together by walking the aligned lengths below D: per group a range-AND structure
   over the request's per-block worker masks answers "all of ``blocks_needed_at(L)`` cached" in
   O(1) after O(prefix blocks) preparation. A worker gets the first length every group serves.

``HitRules.longest_hit`` runs the coordinator's unchanged ``find_longest_cache_hit`` on a shadow
coordinator whose managers look at one worker's hash sets: the reference the tests compare with.

Event stream discipline: a worker's events carry consecutive sequence numbers. A gap marks the
worker stale: later events are buffered and the caller is asked (``needs_resync``) for a
``WorkerSnapshot`` of the worker's pool; applying it replays the buffered events newer than the
snapshot. A stale worker keeps predicting from its last known state.

``PrefixIndex`` lives whole here: membership and per-worker queries, prediction (steps 1-3),
then event and snapshot application.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import accumulate, repeat
from operator import and_

from benchmarks.support.mask_router.worker_masks import RangeAnd, contiguous_depths, sliding_and
from engine.kv_cache.block_queue import TIER_EXPLICIT, TIER_NONE, TIER_RETAINED
from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    KVEvent,
)
from engine.kv_cache.spec import KVCacheGroup
from engine.routing.hit_rules import (
    PREFIX,
    GroupHash,
    HitRules,
    WorkerSnapshot,
    snapshot_coordinator,
)
from engine.routing.host_maps import HostMaps

WorkerId = Hashable

FEW_WORKERS = 3  # resolve up to this many workers one by one (reference fixed point)


@dataclass
class Pending:
    """Workers whose hit is below their full-attention depth, not yet resolved (see ``predict``)."""

    workers: int
    steps: int
    views: list[list[bytes]]
    groups: list[int]
    hashes: Sequence[bytes] = ()
    skip_mamba: bool = False


#: events buffered for a stale worker before the index gives up on replaying them (then it asks
#: for another snapshot once the current one is applied).
MAX_BUFFERED_EVENTS = 200_000


class _Worker:
    """One tracked worker: its slot (``bit == 1 << slot``), per-group hash -> pin level tables, and
    its place in its event stream (``last_seq``; while ``stale``, newer events wait in ``buffer``
    for the next snapshot, ``overflowed`` once some were dropped)."""

    __slots__ = ("bit", "buffer", "last_seq", "overflowed", "slot", "stale", "tables", "worker")

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
    """Per worker, per group: cached hashes and pin levels; per group: hash -> worker bitmask.

    Invariants: a worker's slot is unique among tracked workers, its bit is ``1 << slot`` and
    ``all_mask`` is the OR of the tracked workers' bits. Events: per worker, ``tables[g]`` holds
    exactly the hashes its pool announced for group ``g`` up to ``last_seq``, with their pin level
    (0 none, 1 retained, 2 explicit); for every group and hash, ``_owners[g][hash]`` is the OR of
    the bits of the workers whose table holds the hash, and no entry is 0; a stale worker applies
    nothing until a snapshot, buffering at most ``MAX_BUFFERED_EVENTS`` events (``overflowed``
    past that); events with seq <= ``last_seq`` are ignored. Prediction: a worker's predicted hit
    equals what its coordinator's ``find_longest_cache_hit`` would return on the index's view of
    its cache (``HitRules.longest_hit``, the reference path); only non-zero hits are reported,
    each a multiple of ``rules.alignment`` and <= ``max_length``; only workers in ``all_mask``
    (and in ``mask`` when given) are considered; ``Pending.workers`` only loses workers as
    ``resolve`` settles them.
    """

    def __init__(self, groups: Sequence[KVCacheGroup]):
        self.rules = HitRules(groups)
        self.num_groups = len(self.rules.groups)
        self._workers: dict[WorkerId, _Worker] = {}
        self._by_slot: list[_Worker | None] = []
        self._free_slots: list[int] = []
        self._owners: list[dict[bytes, int]] = [{} for _ in range(self.num_groups)]
        self.all_mask = 0
        # no host tiers here: always empty, so ``engine.routing.pins.PinTable`` reads only the device
        self.host = HostMaps(self.num_groups)

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

    def bit(self, worker: WorkerId) -> int:
        return self._workers[worker].bit

    # -- prediction ---------------------------------------------------------------------------------
    def predict(
        self,
        hashes: Sequence[bytes],
        max_length: int,
        skip_mamba: bool = False,
        mask: int | None = None,
        shared: dict[WorkerId, int] | None = None,
    ) -> dict[WorkerId, int]:
        """Predicted hit length on every worker with a non-zero hit (``mask``: only these slots).

        ``max_length`` is what the coordinator is asked: ``num_tokens - 1`` for a new request.
        ``shared``, if given, receives each worker's aligned full-attention depth where it is
        non-zero: the coordinator's ``CacheHit.shared_prefix_tokens`` there, the boundary whose
        blocks its retention tier keeps when the request is freed.
        """
        hits, pending = self.predict_partial(hashes, max_length, skip_mamba, mask, shared)
        if pending is not None:
            self.resolve(pending, hits)
        return hits

    def predict_partial(
        self,
        hashes: Sequence[bytes],
        max_length: int,
        skip_mamba: bool = False,
        mask: int | None = None,
        shared: dict[WorkerId, int] | None = None,
    ) -> tuple[dict[WorkerId, int], Pending | None]:
        """``predict`` without step 3: the hits known so far, and the workers that cannot serve
        their full-attention depth (their hit is shorter than ``shared[w]``), to ``resolve`` later
        (all of them, or only those a caller still needs)."""
        rules = self.rules
        alive = self.all_mask if mask is None else mask & self.all_mask
        align = rules.alignment
        steps = max_length // align if max_length > 0 else 0
        if steps <= 0 or not alive:
            return {}, None
        views = rules.views(hashes)
        rules.ensure(steps)
        checks = [g for g in rules.order if not (skip_mamba and g in rules.mamba_groups)]
        hits: dict[WorkerId, int] = {}
        if not rules.full_groups:
            return hits, Pending(alive, steps, views, checks, hashes, skip_mamba)
        # 1. The first full-attention group's contiguous depth of every worker, in one walk.
        g0 = checks.pop(0)
        per0 = align // rules.block_sizes[g0]
        limit = min(steps * per0, len(views[g0]))
        stops = contiguous_depths(views[g0], limit - limit % per0, self._owners[g0], alive)
        failing = 0
        deepest = 0
        for nblocks, workers in reversed(stops):
            k = nblocks // per0
            if k <= 0:
                continue
            if shared is not None:
                for worker in self.workers_in(workers):
                    shared[worker] = k * align
            # 2. Workers every other group serves at that depth: the common case.
            valid = self._serving(workers, views, checks, k)
            for worker in self.workers_in(valid):
                hits[worker] = k * align
            if workers & ~valid:
                failing |= workers & ~valid
                deepest = max(deepest, k)
        if not failing:
            return hits, None
        return hits, Pending(failing, deepest - 1, views, [g0, *checks], hashes, skip_mamba)

    def resolve(self, pending: Pending, hits: dict[WorkerId, int], mask: int | None = None) -> None:
        """Step 3 for the pending workers (or those of them in ``mask``): the longest shorter length
        every group serves, full attention included. Adds non-zero hits to ``hits``."""
        workers = pending.workers if mask is None else pending.workers & mask
        if not workers:
            return
        pending.workers &= ~workers
        if workers.bit_count() <= FEW_WORKERS:
            # A few workers: the coordinator's own fixed point on each is cheaper than the bulk pass.
            length = pending.steps * self.rules.alignment
            for worker in self.workers_in(workers):
                found = self.hit(worker, pending.hashes, length, pending.skip_mamba)
                if found:
                    hits[worker] = found
            return
        self._resolve(workers, pending.steps, pending.views, pending.groups, hits)

    def _serving(self, workers: int, views: list[list[bytes]], checks: list[int], k: int) -> int:
        """The workers among ``workers`` that hold, in every group of ``checks``, the blocks a hit
        of ``k`` aligned steps needs."""
        ranges = self.rules._ranges
        for g in checks:
            start, stop = ranges[g][k]
            if stop - start == 1:
                workers &= self._owners[g].get(views[g][start], 0)
            else:
                workers = reduce(and_, map(self._owners[g].get, views[g][start:stop], repeat(0)), workers)
            if not workers:
                return 0
        return workers

    def _resolve(
        self, workers: int, steps: int, views: list[list[bytes]], groups: list[int], hits: dict[WorkerId, int]
    ) -> None:
        """Give each of ``workers`` the longest length <= ``steps`` aligned steps that every group in
        ``groups`` serves: per group, the servers of every length at once (``_valid_ends``), then
        one downward scan."""
        align = self.rules.alignment
        serving: list[int] | None = None
        for g in groups:
            steps = min(steps, len(views[g]) * self.rules.block_sizes[g] // align)
            if steps <= 0:
                return
            ends = self._valid_ends(g, views[g], steps, workers)
            serving = ends if serving is None else [a & b for a, b in zip(serving, ends, strict=True)]
        assert serving is not None
        remaining = workers
        for k in range(steps, 0, -1):
            found = serving[k] & remaining
            if found:
                for worker in self.workers_in(found):
                    hits[worker] = k * align
                remaining &= ~found
                if not remaining:
                    return

    def _valid_ends(self, g: int, view: Sequence[bytes], steps: int, alive: int) -> list[int]:
        """``ends[k]``: the workers (within ``alive``) that hold every block group ``g`` needs for
        a hit of ``k * alignment`` tokens (``blocks_needed_at``), for k = 0..steps."""
        rules = self.rules
        per = rules.alignment // rules.block_sizes[g]
        blocks = steps * per
        present = list(map(self._owners[g].get, view[:blocks], repeat(0)))
        shape = rules.shapes[g]
        if shape == PREFIX:
            return list(accumulate(present, and_, initial=alive))[::per]
        if shape >= 1:  # a window of ``shape`` blocks ending at the hit (fewer near the start)
            width = shape
            head = min(steps, width // per)  # steps whose window reaches back to block 0
            ends = list(accumulate(present[: head * per], and_, initial=alive))[::per]
            if steps > head:
                windows = sliding_and(present, width)  # windows[s]: AND of present[s : s + width]
                ends.extend([alive & w for w in windows[(head + 1) * per - width :: per]])
            return ends
        ranges = rules.needed_ranges(g, steps)
        table = RangeAnd(present)
        return [alive & table.all_of(a, b) for a, b in ranges]

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
                    table[block_hash] = TIER_NONE
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
                if lost is not None and (g, block_hash) in watched:  # type: ignore[operator]  # watched is set whenever lost is
                    lost.append((g, block_hash))
        elif isinstance(event, BlockPinned):
            table = state.tables[event.group]
            level = TIER_EXPLICIT if event.explicit else TIER_RETAINED
            for block_hash in event.block_hashes:
                if table.get(block_hash, level) < level:
                    table[block_hash] = level
        elif isinstance(event, BlockUnpinned):
            g = event.group
            table = state.tables[g]
            for block_hash in event.block_hashes:
                if block_hash in table:
                    table[block_hash] = TIER_NONE
                    if lost is not None and (g, block_hash) in watched:  # type: ignore[operator]  # watched is set whenever lost is
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


__all__ = [
    "FEW_WORKERS",
    "MAX_BUFFERED_EVENTS",
    "EventOutcome",
    "GroupHash",
    "HitRules",
    "Pending",
    "PrefixIndex",
    "WorkerSnapshot",
    "snapshot_coordinator",
]
