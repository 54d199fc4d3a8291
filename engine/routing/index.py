"""The global prefix index: which worker caches which block, per KV-cache group, fed by KV events.

Per group the index keeps one map ``hash -> holders``: the workers whose block pool announced the
hash, each with its pin level (0 none, 1 retained, 2 explicit), in a ``HolderMaps``
(``engine.routing.holder_maps``: compiled from ``_core.c`` when built, else pure Python; the two
agree exactly). No per-key structure grows with the fleet: holders are small sets of worker
slots. A worker's own view of its cache (``cached``, ``pin_level``, the reference fixed point) is
read from the same maps.

Prediction applies the worker coordinator's own hit rules (``HitRules``). Every group's manager
says which blocks a hit at length L needs (``blocks_needed_at(L)``: the whole prefix for full
attention, the ``blocks_for_hit`` blocks ending at L for a sliding window, the state block ending at
L for Mamba); a group serves L iff those blocks are cached. ``find_longest_cache_hit`` returns the
longest aligned L <= max_length that every group serves (each group's own search returns the
longest length <= its input that it serves, so the coordinator's fixed point over groups stops
exactly there). The index computes that length for the holders of the prompt's blocks only, so a
prediction costs O(prefix blocks + holders met), whatever the number of workers:

1. walk the full-attention group's hashes once: the holders of block 0, narrowed where the holder
   value changes along the chain (consecutive blocks of one cached prefix carry equal values, so
   the walk intersects sets only at the few change points): each holder's contiguous depth D;
2. per distinct depth D, the holders that also hold the blocks every other group needs at D hit
   exactly D (the common case);
3. the holders that fail (a window or a Mamba state is missing at D, e.g. a group lost blocks)
   are resolved one by one by the coordinator's unchanged fixed point on the index's view of
   their cache (``hit``). Without a full-attention group every holder of a block of the first
   checked group is resolved that way.

``HitRules.longest_hit`` runs the coordinator's unchanged ``find_longest_cache_hit`` on a shadow
coordinator whose managers look at one worker's hash sets: the reference the tests compare with.

Host tiers (docs/architecture.md, "The hybrid KV cache": the host tier). A worker with a host tier
serves a group's needed block from either tier, so its hit may be longer than the device maps
say. The index keeps the host tiers in ``HostMaps`` (``engine.routing.host_maps``, fed by
``BlockOffloaded`` / ``BlockDropped``) beside the device maps, and after steps 1-2 re-predicts
over both tiers only the workers that hold one of the prompt's blocks in their host tier (the
others' device prediction is already exact), in one call into the holder maps
(``HolderMaps.tiered``: per such worker one walk over the prompt's blocks in both tiers, the
longest aligned length every group serves from either, which is where the coordinator's fixed
point with a host tier stops; with a full-attention group, steps 1-2 and that walk are one call,
``HolderMaps.predict_tiered``, which also picks the pending workers the host may lift). That
prediction also says how many of the hit's tokens the host tier serves (``host``). Its reference
is the fixed point itself run on the worker (``tiered_hit``: ``HitRules.tiered_hit``, the shadow
coordinator over both tiers), which the tests compare it with. A fleet without host tiers pays
one integer test per prediction.

Event stream discipline: a worker's events carry consecutive sequence numbers. While a worker is
not stale and has no watched pin keys, a run of its stored / removed / pinned events continuing
the stream is applied by the holder maps in one call (``HolderMaps.absorb``); every other event
goes through the per-event path below, with the same result. A gap marks the
worker stale: later events are buffered and the caller is asked (``needs_resync``) for a
``WorkerSnapshot`` of the worker's pool; applying it replays the buffered events newer than the
snapshot. A stale worker keeps predicting from its last known state. Forgetting a worker's
whole cache (removal, a snapshot, ``AllBlocksCleared``) walks the keys it announced (a list per
worker in the holder maps, compacted as it grows), not the whole index.

``PrefixIndex`` lives whole here: membership and per-worker queries, prediction (steps 1-3),
then event and snapshot application.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from engine.kv_cache.block_queue import TIER_EXPLICIT, TIER_NONE, TIER_RETAINED
from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockDropped,
    BlockOffloaded,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    KVEvent,
)
from engine.kv_cache.hashing import coarse_view
from engine.kv_cache.spec import KVCacheGroup
from engine.routing.hit_rules import (
    GroupHash,
    HitRules,
    TieredHit,
    WalkPlan,
    WorkerSnapshot,
    snapshot_coordinator,
)
from engine.routing.holder_maps import Absorbed, HolderMaps, PyHolderMaps, make_holder_maps
from engine.routing.host_maps import HostMaps

WorkerId = Hashable


@dataclass
class Pending:
    """Holders whose hit is below their full-attention depth, not yet resolved (see ``predict``):
    each is resolved by the coordinator's fixed point with ``max_length = length``."""

    workers: set[WorkerId]
    length: int
    hashes: Sequence[bytes]
    skip_mamba: bool = False


#: the events ``HolderMaps.absorb`` applies in one call (the rest go through ``_apply``)
ABSORBED: Absorbed = (BlockStored, BlockRemoved, BlockPinned)

#: events buffered for a stale worker before the index gives up on replaying them (then it asks
#: for another snapshot once the current one is applied).
MAX_BUFFERED_EVENTS = 200_000


class _Worker:
    """One tracked worker: its slot in the holder maps (which keep its keys and their count) and
    its place in its event stream (``last_seq``; while ``stale``, newer events wait in ``buffer``
    for the next snapshot, ``overflowed`` once some were dropped)."""

    __slots__ = ("buffer", "last_seq", "overflowed", "slot", "stale", "worker")

    def __init__(self, worker: WorkerId, slot: int):
        self.worker = worker
        self.slot = slot
        self.last_seq = 0
        self.stale = False
        self.buffer: list[KVEvent] = []
        self.overflowed = False


class _HeldBy(Mapping[bytes, int]):
    """One worker's cache in one group, read from the index's holder maps: hash -> pin level.
    What the shadow managers of ``HitRules.longest_hit`` read (``get``, ``[]``, ``in``)."""

    __slots__ = ("_group", "_maps", "_slot")

    def __init__(self, maps: HolderMaps, group: int, slot: int):
        self._maps = maps
        self._group = group
        self._slot = slot

    def get(self, key: bytes, default: object = None) -> int | None:  # type: ignore[override]
        level = self._maps.level(self._group, key, self._slot)
        return default if level is None else level  # type: ignore[return-value]

    def __getitem__(self, key: bytes) -> int:
        level = self._maps.level(self._group, key, self._slot)
        if level is None:
            raise KeyError(key)
        return level

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._maps.level(self._group, key, self._slot) is not None

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._maps.table(self._group, self._slot))

    def __len__(self) -> int:
        return len(self._maps.table(self._group, self._slot))


@dataclass
class EventOutcome:
    """What applying a batch of events found: whether the worker needs a resync (a gap was seen
    for the first time in this batch), and which watched (group, hash) keys lost their explicit pin
    or their cache entry (``cleared``: the worker's whole cache was reset)."""

    needs_resync: bool = False
    lost: list[GroupHash] | None = None
    cleared: bool = False


class PrefixIndex:
    """Per group: hash -> the holders that announced it, each with its pin level.

    Invariants: a worker's slot is unique among tracked workers and ``_ids[slot]`` names it
    (None: a free slot); the holder maps have exactly the tracked workers' slots. Events: for
    every group ``g`` and hash ``h``, the maps' holders of ``h`` in ``g`` are exactly the tracked
    workers whose pool announced ``h`` for ``g`` up to their ``last_seq`` and has not removed it
    since, with their pin level (0 none, 1 retained, 2 explicit), and no key has an empty holder
    set (the maps' own invariants: ``HolderMaps``); a stale worker applies
    nothing until a snapshot, buffering at most ``MAX_BUFFERED_EVENTS`` events (``overflowed``
    past that); events with seq <= ``last_seq`` are ignored. Prediction: a worker's predicted
    hit equals what its coordinator's ``find_longest_cache_hit`` would return on the index's view
    of its cache (``HitRules.longest_hit``, the reference path); only non-zero hits are
    reported, each a multiple of ``rules.alignment`` and <= ``max_length``; ``Pending.workers``
    only loses workers as ``resolve`` settles them.
    """

    def __init__(self, groups: Sequence[KVCacheGroup], core: str | None = None):
        """``core``: which holder maps (``make_holder_maps``: "compiled", "python", "auto";
        None reads ``KVFLEET_ROUTING_CORE``)."""
        self.rules = HitRules(groups)
        self.num_groups = len(self.rules.groups)
        self._workers: dict[WorkerId, _Worker] = {}
        self._ids: list[WorkerId] = []  # the worker in each slot (None: free)
        self._free_slots: list[int] = []
        self._maps: HolderMaps = make_holder_maps(self.num_groups, core)
        # the workers' host tiers (consulted only for workers holding a prompt's block there)
        kind = "python" if isinstance(self._maps, PyHolderMaps) else "compiled"  # the device maps' kind
        self.host = HostMaps(self.num_groups, make_holder_maps(self.num_groups, kind))

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
        slot = self._free_slots.pop() if self._free_slots else len(self._ids)
        state = _Worker(worker, slot)
        self._maps.add_slot(slot)
        if slot == len(self._ids):
            self._ids.append(worker)
        else:
            self._ids[slot] = worker
        self._workers[worker] = state
        if snapshot is not None:
            self.apply_snapshot(worker, snapshot)

    def remove_worker(self, worker: WorkerId) -> None:
        state = self._workers.pop(worker, None)
        if state is None:
            return
        self._clear(state)
        self._maps.release_slot(state.slot)
        self._ids[state.slot] = None
        self._free_slots.append(state.slot)

    def slot_of(self, worker: WorkerId) -> int:
        return self._workers[worker].slot

    # -- queries ------------------------------------------------------------------------------------
    def is_stale(self, worker: WorkerId) -> bool:
        return self._workers[worker].stale

    def last_seq(self, worker: WorkerId) -> int:
        return self._workers[worker].last_seq

    def cached(self, worker: WorkerId, group: int, block_hash: bytes) -> bool:
        return self.pin_level(worker, group, block_hash) is not None

    def pin_level(self, worker: WorkerId, group: int, block_hash: bytes) -> int | None:
        """The announced pin level of a cached hash (None when not cached)."""
        return self._maps.level(group, block_hash, self._workers[worker].slot)

    def holders(self, group: int, block_hash: bytes) -> list[WorkerId]:
        """The workers holding ``block_hash`` in ``group``, in slot order."""
        ids = self._ids
        return [ids[s] for s in self._maps.holders(group, block_hash)]

    def tables(self, worker: WorkerId) -> list[dict[bytes, int]]:
        """The worker's per-group hash -> pin level maps (a copy, built by a scan: tests and tools)."""
        slot = self._workers[worker].slot
        return [self._maps.table(g, slot) for g in range(self.num_groups)]

    def num_cached(self, worker: WorkerId) -> int:
        return self._maps.num_cached(self._workers[worker].slot)

    def hit(self, worker: WorkerId, hashes: Sequence[bytes], max_length: int, skip_mamba: bool = False) -> int:
        """The predicted hit on one worker by the coordinator's own fixed point (reference path;
        over both tiers where the worker has a host tier)."""
        slot = self._workers[worker].slot
        views = [_HeldBy(self._maps, g, slot) for g in range(self.num_groups)]
        if self.host.count(slot):
            return self.rules.tiered_hit(views, self.host.views(slot), hashes, max_length, skip_mamba).tokens
        return self.rules.longest_hit(views, hashes, max_length, skip_mamba)

    def tiered_hit(
        self, worker: WorkerId, hashes: Sequence[bytes], max_length: int, skip_mamba: bool = False
    ) -> TieredHit:
        """The predicted hit on one worker over both of its tiers, with the host tier's part."""
        slot = self._workers[worker].slot
        views = [_HeldBy(self._maps, g, slot) for g in range(self.num_groups)]
        return self.rules.tiered_hit(views, self.host.views(slot), hashes, max_length, skip_mamba)

    def host_tables(self, worker: WorkerId) -> list[dict[bytes, int]]:
        """The worker's per-group host-tier hash -> pin level maps (a copy, by a scan: tests)."""
        return [dict(view.items()) for view in self.host.views(self._workers[worker].slot)]

    # -- prediction ---------------------------------------------------------------------------------
    def predict(
        self,
        hashes: Sequence[bytes],
        max_length: int,
        skip_mamba: bool = False,
        shared: dict[WorkerId, int] | None = None,
    ) -> dict[WorkerId, int]:
        """Predicted hit length on every worker with a non-zero hit.

        ``max_length`` is what the coordinator is asked: ``num_tokens - 1`` for a new request.
        ``shared``, if given, receives each worker's aligned full-attention depth where it is
        non-zero: the coordinator's ``CacheHit.shared_prefix_tokens`` there, the boundary whose
        blocks its retention tier keeps when the request is freed.
        """
        hits, pending, _ = self.predict_partial(hashes, max_length, skip_mamba, shared)
        if pending is not None:
            self.resolve(pending, hits)
        return hits

    def predict_partial(
        self,
        hashes: Sequence[bytes],
        max_length: int,
        skip_mamba: bool = False,
        shared: dict[WorkerId, int] | None = None,
        host: dict[WorkerId, int] | None = None,
    ) -> tuple[dict[WorkerId, int], Pending | None, int]:
        """``predict`` without step 3: the hits known so far, and the holders that cannot serve
        their full-attention depth (their hit is shorter than ``shared[w]``), to ``resolve`` later
        (all of them, or only those a caller still needs). Workers holding one of the prompt's
        blocks in their host tier are predicted over both tiers here (never pending); ``host``,
        if given, receives the host tier's part of each such worker's hit where it is non-zero.
        Third: the deepest full-attention depth of any worker (tokens; 0: none): the largest value
        ``shared`` (given empty) receives, found by the walk itself (``HolderMaps.predict``).

        Steps 1-2 run inline on the device maps (one decision, one call: the router's hot path)."""
        hits: dict[WorkerId, int] = {}
        pending: Pending | None = None
        reach = 0
        rules = self.rules
        align = rules.alignment
        steps = max_length // align if max_length > 0 else 0
        if steps > 0 and self._workers:
            rules.ensure(steps)
            plan = rules.walk_plans[1 if skip_mamba else 0]
            view = hashes if isinstance(hashes, list) else list(hashes)
            if plan is not None and not rules.full_groups:
                pending = self._pending_without_full(plan, view, steps, skip_mamba)
            elif plan is not None:
                # 1. The first full-attention group's contiguous depth of every holder, in one
                # walk; 2. per depth, the holders every other group serves there (the common
                # case). The maps read each group's view of the request's hashes in place.
                per = plan.per
                limit = min(steps * per, len(view) // plan.factor)
                limit -= limit % per
                host_maps = self.host
                if host_maps.total:  # and over both tiers, in the same call (``_predict_tiered``)
                    failed, deepest, reach = self._maps.predict_tiered(
                        plan.first,
                        view,
                        plan.factor,
                        limit,
                        per,
                        plan.checks,
                        align,
                        self._ids,
                        hits,
                        shared,
                        plan.order,
                        host_maps.maps,
                        host_maps.counts,
                        steps,
                        rules.hash_block_size,
                        plan.prefix,
                        host,
                    )
                    if failed is not None:
                        pending = Pending(failed, (deepest - 1) * align, hashes, skip_mamba)
                    return hits, pending, reach
                failing, deepest, reach = self._maps.predict(
                    plan.first, view, plan.factor, limit, per, plan.checks, align, self._ids, hits, shared
                )
                if failing:
                    pending = Pending(set(failing), (deepest - 1) * align, hashes, skip_mamba)
            if plan is not None and self.host.total:
                self._predict_tiered(view, steps, plan, hits, pending, shared, host)
        return hits, pending, reach

    def _pending_without_full(
        self, plan: WalkPlan, hashes: Sequence[bytes], steps: int, skip_mamba: bool
    ) -> Pending | None:
        """Without a full-attention group: every holder of a block of the first checked group
        (within ``steps`` aligned steps) is resolved by the fixed point (step 3)."""
        view = coarse_view(hashes if isinstance(hashes, list) else list(hashes), plan.factor)
        met = self._maps.met(plan.first, view[: steps * plan.per])
        if not met:
            return None
        ids = self._ids
        return Pending({ids[s] for s in met}, steps * self.rules.alignment, hashes, skip_mamba)

    def _predict_tiered(
        self,
        view: list[bytes],
        steps: int,
        plan: WalkPlan,
        hits: dict[WorkerId, int],
        pending: Pending | None,
        shared: dict[WorkerId, int] | None,
        host: dict[WorkerId, int] | None,
    ) -> None:
        """Re-predict, over both tiers, the workers holding some block of the prompt ``view``
        (within ``steps`` aligned steps, the rules ensured that far; ``plan``: the walk's) in
        their host tier (with a full-attention group: a block of the first one, or any block for
        a worker whose device hit is below its depth, in ``pending``): for any other worker both
        tiers give the device hit. One call into the holder maps (``HolderMaps.tiered``: one walk
        per such worker over both tiers); its reference is the coordinator's fixed point on each
        (``tiered_hit``). ``view`` is the list the device walk just read, so the compiled maps
        reuse the entries it met."""
        rules = self.rules
        extra: list[int] = []
        if pending is not None and plan.prefix:  # the device hit below the depth: a host window may lift it
            counts, workers = self.host.counts, self._workers
            extra = [slot for slot in (workers[w].slot for w in pending.workers) if slot in counts]
        self._maps.tiered(
            view,
            plan.order,
            self.host.maps,
            steps,
            rules.alignment,
            rules.hash_block_size,
            plan.prefix,
            self._ids,
            hits,
            shared if rules.full_groups else None,
            host,
            None if pending is None else pending.workers,
            extra,
        )

    def resolve(self, pending: Pending, hits: dict[WorkerId, int], only: Iterable[WorkerId] | None = None) -> None:
        """Step 3 for the pending holders (or those of them in ``only``): the coordinator's fixed
        point on each (the longest shorter length every group serves). Adds non-zero hits to ``hits``."""
        workers = pending.workers if only is None else pending.workers.intersection(only)
        if not workers:
            return
        for worker in list(workers):
            pending.workers.discard(worker)
            found = self.hit(worker, pending.hashes, pending.length, pending.skip_mamba)
            if found:
                hits[worker] = found

    # -- events -------------------------------------------------------------------------------------
    def apply_events(
        self, worker: WorkerId, events: Iterable[KVEvent], watched: Mapping[GroupHash, object] | None = None
    ) -> EventOutcome:
        """Apply a worker's events in order; duplicates (seq <= last) are ignored, a gap starts a
        resync. ``watched`` keys that lose their explicit pin or their entry in either tier are
        reported (candidates: the pin table decides, ``PinTable.key_tier``)."""
        state = self._workers.get(worker)
        outcome = EventOutcome()
        if state is None:
            return outcome
        lost: list[GroupHash] | None = [] if watched else None
        events = events if isinstance(events, list) else list(events)
        # Without watched keys the common events go to the maps in one call (``HolderMaps.absorb``);
        # the loop below takes the others (and everything of a stale worker), one at a time.
        absorb = self._maps.absorb if lost is None else None
        i, n = 0, len(events)
        while i < n:
            if absorb is not None and not state.stale:
                i, state.last_seq = absorb(events, i, state.slot, state.last_seq, ABSORBED)
                if i >= n:
                    break
            event = events[i]
            i += 1
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
        maps = self._maps
        self._clear(state)
        for g, table in enumerate(snapshot.groups):
            maps.hold(g, table.items(), state.slot)
        maps.compact(state.slot)
        self.host.load(state.slot, snapshot.host)
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
        maps = self._maps
        if isinstance(event, BlockStored):
            maps.store(event.group, event.block_hashes, state.slot)
        elif isinstance(event, BlockRemoved):
            gone = maps.remove(event.group, event.block_hashes, state.slot, lost is not None)
            if gone:
                self._report(event.group, gone, watched, lost)
        elif isinstance(event, BlockPinned):
            level = TIER_EXPLICIT if event.explicit else TIER_RETAINED
            maps.relevel(event.group, event.block_hashes, state.slot, level, True, False)
        elif isinstance(event, BlockUnpinned):
            held = maps.relevel(event.group, event.block_hashes, state.slot, TIER_NONE, False, lost is not None)
            if held:
                self._report(event.group, held, watched, lost)
        elif isinstance(event, AllBlocksCleared):
            self._clear(state)
            state.last_seq = event.seq
            return True
        elif isinstance(event, BlockOffloaded):
            self.host.add(state.slot, event.group, event.block_hashes)
        elif isinstance(event, BlockDropped):
            self.host.drop(state.slot, event.group, event.block_hashes)
            if lost is not None:  # a watched key left the host tier (a pin may live there)
                self._report(event.group, event.block_hashes, watched, lost)
        return False

    def _clear(self, state: _Worker) -> None:
        """Forget every key ``state`` holds, in both tiers (a walk over the keys it announced)."""
        self.host.clear(state.slot)
        self._maps.clear(state.slot)

    @staticmethod
    def _report(
        g: int, keys: Sequence[bytes], watched: Mapping[GroupHash, object] | None, lost: list[GroupHash] | None
    ) -> None:
        """Add the watched ones of ``keys`` (group ``g``) to ``lost``."""
        if watched is None or lost is None:
            return
        lost.extend((g, block_hash) for block_hash in keys if (g, block_hash) in watched)


__all__ = [
    "MAX_BUFFERED_EVENTS",
    "EventOutcome",
    "GroupHash",
    "HitRules",
    "Pending",
    "PrefixIndex",
    "TieredHit",
    "WorkerSnapshot",
    "snapshot_coordinator",
]
