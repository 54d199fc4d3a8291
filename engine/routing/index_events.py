"""How ``PrefixIndex`` follows a worker's KV events (the event stream discipline of
``engine.routing.index``'s docstring): ``apply_events`` / ``apply_snapshot``, the per-worker record
they update (``_Worker``: its tables, sequence number and resync buffer), ``EventOutcome`` and
the buffer limit ``MAX_BUFFERED_EVENTS``.

Split out of ``engine.routing.index``: ``IndexEvents`` is a mixin of ``PrefixIndex`` and owns no
state; it updates the index's ``_workers`` records and its ``_owners`` bitmask maps.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from engine.kv_cache.block_queue import PIN_EXPLICIT, PIN_NONE, PIN_RETAINED
from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    KVEvent,
)
from engine.routing.hit_rules import GroupHash, WorkerSnapshot

WorkerId = Hashable

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


class IndexEvents:
    """The ``PrefixIndex`` methods that apply KV events and snapshots (mixin, no state of its own).

    Invariants: per worker, ``tables[g]`` holds exactly the hashes its pool announced for group
    ``g`` up to ``last_seq``, with their pin level (0 none, 1 retained, 2 explicit); for every
    group and hash, ``_owners[g][hash]`` is the OR of the bits of the workers whose table holds the
    hash, and no entry is 0; a stale worker applies nothing until a snapshot, buffering at most
    ``MAX_BUFFERED_EVENTS`` events (``overflowed`` past that); events with seq <= ``last_seq`` are
    ignored.
    """

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
