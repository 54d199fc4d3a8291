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

This module keeps ``PrefixIndex``'s membership and per-worker queries; prediction (steps 1-3) is
its ``HitPrediction`` mixin in ``hit_prediction``, event and snapshot application its
``IndexEvents`` mixin in ``index_events``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

from engine.kv_cache.spec import KVCacheGroup
from engine.routing.hit_prediction import FEW_WORKERS, HitPrediction, Pending
from engine.routing.hit_rules import (
    GroupHash,
    HitRules,
    WorkerSnapshot,
    snapshot_coordinator,
)
from engine.routing.index_events import (
    MAX_BUFFERED_EVENTS,
    EventOutcome,
    IndexEvents,
    _Worker,
)

WorkerId = Hashable


class PrefixIndex(HitPrediction, IndexEvents):
    """Per worker, per group: cached hashes and pin levels; per group: hash -> worker bitmask.

    Membership and per-worker queries live here; prediction in ``HitPrediction``
    (``engine.routing.hit_prediction``), event and snapshot application in ``IndexEvents``
    (``engine.routing.index_events``). Invariant: a worker's slot is unique among tracked workers,
    its bit is ``1 << slot`` and ``all_mask`` is the OR of the tracked workers' bits.
    """

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

    def bit(self, worker: WorkerId) -> int:
        return self._workers[worker].bit


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
