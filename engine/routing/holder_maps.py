"""The prefix index's device holder maps: per KV-cache group, block hash -> the worker slots whose
pool announced it, each with its pin level (0 none, 1 retained, 2 explicit), and the prediction's
walk over them (``engine.routing.index`` describes the walk's two steps).

Two implementations of one interface (``HolderMaps``):

- ``engine.routing._core.HolderMaps``, compiled from ``_core.c`` at install time (``setup.py``):
  32-byte hashes stored inline in one open-addressing table for every group, one 32-bit holder
  value per key and group (a prompt's blocks are the same hashes in every group, so the walk's
  checks of the other groups read entries its first group's walk just brought into the cache);
- ``PyHolderMaps`` below, pure Python (a dict per group), the reference the compiled maps are
  tested against, and what runs where the extension was not built.

``make_holder_maps`` picks one: the compiled maps when they import, unless ``KVFLEET_ROUTING_CORE``
says ``python``; ``compiled`` there makes a missing extension an error.

Two calls exist so that the router's two hot paths cross into the maps once, not once per item:
``predict`` runs the walk and writes its results into the caller's hit maps keyed by worker (a
decision), with the deepest full-attention depth it met (the policy's prefix reuse reads it, no
second pass), and ``absorb`` applies a run of a worker's stored, removed and pinned events (the
index's per-event loop takes any other event, a gap, or a worker with watched pin keys).
``tiered`` is ``predict``'s counterpart over both tiers: the workers holding some of the prompt's
blocks in their host tier (``engine.routing.host_maps``), each walked once over the prompt's
blocks in either tier, results written into the same dicts; ``predict_tiered`` runs both in one
call. The compiled maps prefetch the index word and the entry a few keys ahead in every loop over
a list of keys: a lookup in a large table is about two cache misses.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Hashable, Iterable, Sequence
from itertools import repeat
from typing import Protocol

from engine.kv_cache.events import BlockPinned, BlockRemoved, BlockStored, KVEvent
from engine.kv_cache.hashing import coarse_view

#: a key's holders: their codes ``slot << 2 | level`` in increasing slot order (never empty)
Holders = tuple[int, ...]
NOBODY: Holders = ()  # what the walk reads for a key nobody holds
#: one group's part of step 2: (group, its hash factor: its view of the request's hashes is every
#: factor-th one (``coarse_view``), per aligned step k the range of blocks a hit of k steps needs
#: there)
Check = tuple[int, int, list[tuple[int, int]]]
#: one result of the walk: (aligned steps k, slots that hit k steps, slots whose full-attention
#: depth is k steps but that miss a block another group needs there)
Stop = tuple[int, list[int], list[int]]

#: the event types ``absorb`` applies itself, exactly these classes (not subclasses)
Absorbed = tuple[type[BlockStored], type[BlockRemoved], type[BlockPinned]]

CORE_ENV = "KVFLEET_ROUTING_CORE"


class HolderMaps(Protocol):
    """Per group, hash -> holders (slot and pin level); per slot, the keys it announced.

    Invariants (both implementations): a key maps to at least one holder; a slot holds a key at
    most once; ``num_cached(slot)`` counts the (group, key) entries the slot holds; every key the
    slot holds in a group is in its key list there (``listed`` counts the list entries, some
    stale or repeated; ``store`` compacts when ``2 * listed > 3 * num_cached + 128``)."""

    def add_slot(self, slot: int) -> None: ...
    def release_slot(self, slot: int) -> None: ...
    def clear(self, slot: int) -> None: ...
    def compact(self, slot: int) -> None: ...
    def num_cached(self, slot: int) -> int: ...
    def listed(self, slot: int) -> int: ...
    def store(self, group: int, keys: Sequence[bytes], slot: int) -> None: ...
    def hold(self, group: int, entries: Iterable[tuple[bytes, int]], slot: int) -> None: ...
    def remove(self, group: int, keys: Sequence[bytes], slot: int, report: bool) -> list[bytes] | None: ...
    def relevel(
        self, group: int, keys: Sequence[bytes], slot: int, level: int, raise_only: bool, report: bool
    ) -> list[bytes] | None: ...
    def level(self, group: int, key: bytes, slot: int) -> int | None: ...
    def holders(self, group: int, key: bytes) -> list[int]: ...
    def table(self, group: int, slot: int) -> dict[bytes, int]: ...
    def size(self, group: int) -> int: ...
    def met(self, group: int, keys: Sequence[bytes]) -> set[int]: ...
    def absorb(
        self, events: list[KVEvent], start: int, slot: int, last_seq: int, kinds: Absorbed
    ) -> tuple[int, int]: ...
    def walk(
        self, first: int, hashes: list[bytes], factor: int, limit: int, per: int, checks: list[Check]
    ) -> list[Stop]: ...
    def predict(
        self,
        first: int,
        hashes: list[bytes],
        factor: int,
        limit: int,
        per: int,
        checks: list[Check],
        align: int,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
    ) -> tuple[list[Hashable], int, int]: ...
    def predict_tiered(
        self,
        first: int,
        hashes: list[bytes],
        factor: int,
        limit: int,
        per: int,
        checks: list[Check],
        align: int,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        order: list[Check],
        host: HolderMaps,
        counts: dict[int, int],
        steps: int,
        unit: int,
        prefix: bool,
        host_hits: dict[Hashable, int] | None,
    ) -> tuple[set[Hashable] | None, int, int]: ...
    def tiered(
        self,
        hashes: list[bytes],
        order: list[Check],
        host: HolderMaps,
        steps: int,
        align: int,
        unit: int,
        prefix: bool,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        host_hits: dict[Hashable, int] | None,
        pending: set[Hashable] | None,
        extra: list[int],
    ) -> int: ...


def _level_of(value: Holders | None, slot: int) -> int | None:
    """The pin level ``slot`` holds a key at (None: it does not hold it)."""
    for code in value or NOBODY:
        if code >> 2 == slot:
            return code & 3
    return None


def _slots(value: Holders) -> set[int]:
    return {value[0] >> 2} if len(value) == 1 else {code >> 2 for code in value}


class _SlotKeys:
    """One slot's holder value when it holds a key alone, per pin level (``alone[level] ==
    (slot << 2 | level,)``, shared by every such key), its entry count and, per group, the keys
    it announced (``listed`` in all)."""

    __slots__ = ("alone", "keys", "listed", "num_cached")

    def __init__(self, slot: int, num_groups: int):
        self.alone = tuple(((slot << 2) | level,) for level in range(3))
        self.keys: list[list[bytes]] = [[] for _ in range(num_groups)]
        self.listed = 0
        self.num_cached = 0


class PyHolderMaps:
    """``HolderMaps`` in pure Python: per group a dict ``hash -> Holders``. A key held by one
    slot stores that slot's shared ``alone[level]`` tuple, one held by several a tuple of codes
    in increasing slot order shared by every key with that holder set (``_tuples``, counted in
    ``_tuple_uses``), so a chain of blocks held by the same workers costs one reference per block
    and the walk compares neighbours by identity."""

    def __init__(self, num_groups: int):
        self.num_groups = num_groups
        self._owners: list[dict[bytes, Holders]] = [{} for _ in range(num_groups)]
        self._slots: dict[int, _SlotKeys] = {}
        self._tuples: dict[Holders, Holders] = {}
        self._tuple_uses: dict[Holders, int] = {}

    # -- slots --------------------------------------------------------------------------------------
    def add_slot(self, slot: int) -> None:
        if slot in self._slots:
            raise ValueError(f"slot: {slot} is already added")
        self._slots[slot] = _SlotKeys(slot, self.num_groups)

    def release_slot(self, slot: int) -> None:
        self.clear(slot)
        del self._slots[slot]

    def clear(self, slot: int) -> None:
        """Forget every key ``slot`` holds (a walk over the keys it announced)."""
        state = self._slots[slot]
        for owners, keys in zip(self._owners, state.keys, strict=True):
            for block_hash in keys:
                self._drop(owners, block_hash, slot)
            keys.clear()
        state.listed = 0
        state.num_cached = 0

    def compact(self, slot: int) -> None:
        """Keep in the slot's key lists only the keys it holds, once each."""
        state = self._slots[slot]
        for g, owners in enumerate(self._owners):
            get = owners.get
            state.keys[g] = [h for h in dict.fromkeys(state.keys[g]) if _level_of(get(h), slot) is not None]
        state.listed = sum(map(len, state.keys))

    def num_cached(self, slot: int) -> int:
        return self._slots[slot].num_cached

    def listed(self, slot: int) -> int:
        return self._slots[slot].listed

    # -- events -------------------------------------------------------------------------------------
    def store(self, group: int, keys: Sequence[bytes], slot: int) -> None:
        owners = self._owners[group]
        get = owners.get
        state = self._slots[slot]
        alone = state.alone[0]
        listed = state.keys[group]
        for block_hash in keys:
            if get(block_hash) is None:  # a key nobody held: the common case, inline
                owners[block_hash] = alone
                listed.append(block_hash)
                state.num_cached += 1
                state.listed += 1
            else:
                self._hold(group, block_hash, slot, 0)
        if 2 * state.listed > 3 * state.num_cached + 128:
            self.compact(slot)

    def hold(self, group: int, entries: Iterable[tuple[bytes, int]], slot: int) -> None:
        for block_hash, level in entries:
            self._hold(group, block_hash, slot, level)

    def remove(self, group: int, keys: Sequence[bytes], slot: int, report: bool) -> list[bytes] | None:
        owners = self._owners[group]
        get = owners.get
        state = self._slots[slot]
        mine = state.alone
        gone: list[bytes] | None = [] if report else None
        for block_hash in keys:
            value = get(block_hash)
            if value is None:
                continue
            if value in mine:  # held by this slot alone: the common case, inline
                del owners[block_hash]
                state.num_cached -= 1
            elif not self._drop(owners, block_hash, slot):
                continue
            if gone is not None:
                gone.append(block_hash)
        return gone

    def relevel(
        self, group: int, keys: Sequence[bytes], slot: int, level: int, raise_only: bool, report: bool
    ) -> list[bytes] | None:
        owners = self._owners[group]
        held: list[bytes] | None = [] if report else None
        for block_hash in keys:
            if self._relevel(owners, block_hash, slot, level, raise_only) is not None and held is not None:
                held.append(block_hash)
        return held

    def absorb(self, events: list[KVEvent], start: int, slot: int, last_seq: int, kinds: Absorbed) -> tuple[int, int]:
        """Apply ``events[start:]`` of the worker in ``slot`` whose last applied sequence number
        is ``last_seq``, in one call, while each is of one of ``kinds`` (exactly: stored, removed
        without reporting, pinned at the level its ``explicit`` says, raising only) and continues
        the stream: an event with seq <= ``last_seq`` is skipped, one after a gap or of another
        type stops the batch. Returns (the index of the first event not consumed, the new
        ``last_seq``): what ``PrefixIndex.apply_events`` does per event, for the common events."""
        i, n = start, len(events)
        while i < n:
            event = events[i]
            if type(event) not in kinds:
                break
            seq = event.seq
            if seq > last_seq:
                if seq != last_seq + 1:
                    break
                if isinstance(event, BlockRemoved):
                    self.remove(event.group, event.block_hashes, slot, False)
                elif isinstance(event, BlockPinned):
                    self.relevel(event.group, event.block_hashes, slot, 2 if event.explicit else 1, True, False)
                elif isinstance(event, BlockStored):
                    self.store(event.group, event.block_hashes, slot)
                last_seq = seq
            i += 1
        return i, last_seq

    # -- queries ------------------------------------------------------------------------------------
    def level(self, group: int, key: bytes, slot: int) -> int | None:
        return _level_of(self._owners[group].get(key), slot)

    def holders(self, group: int, key: bytes) -> list[int]:
        value = self._owners[group].get(key)
        return [] if value is None else sorted(_slots(value))

    def table(self, group: int, slot: int) -> dict[bytes, int]:
        get = self._owners[group].get
        out: dict[bytes, int] = {}
        for block_hash in self._slots[slot].keys[group]:
            level = _level_of(get(block_hash), slot)
            if level is not None:
                out[block_hash] = level
        return out

    def size(self, group: int) -> int:
        return len(self._owners[group])

    def met(self, group: int, keys: Sequence[bytes]) -> set[int]:
        found: set[int] = set()
        for value in set(map(self._owners[group].get, keys)):
            if value is not None:
                found |= _slots(value)
        return found

    # -- the prediction's walk ----------------------------------------------------------------------
    def walk(
        self, first: int, hashes: list[bytes], factor: int, limit: int, per: int, checks: list[Check]
    ) -> list[Stop]:
        """Step 1 over ``view[:limit]``, group ``first``'s view of the request's ``hashes``
        (``coarse_view(hashes, factor)``): each holder's contiguous depth in blocks; per depth
        ``n`` with ``k = n // per >= 1`` aligned steps, step 2: which of those holders hold, in
        every group of ``checks``, the blocks a hit of ``k`` steps needs. Returns ``(k, serving
        slots, failing slots)`` per depth, deepest last."""
        out: list[Stop] = []
        for nblocks, slots in self._depths(coarse_view(hashes, factor), limit, self._owners[first]):
            k = nblocks // per
            if k <= 0:
                continue
            valid = self._serving(slots, hashes, checks, k)
            out.append((k, sorted(valid), sorted(slots - valid)))
        return out

    def predict(
        self,
        first: int,
        hashes: list[bytes],
        factor: int,
        limit: int,
        per: int,
        checks: list[Check],
        align: int,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
    ) -> tuple[list[Hashable], int, int]:
        """``walk``'s results written into the caller's maps, keyed by worker (``ids[slot]``): per
        depth of k steps, ``k * align`` tokens in ``hits`` for each serving slot and in
        ``shared`` (if given) for each serving then each failing slot. Returns the failing
        workers, in walk order, the deepest k with one (0: none) and the *reach*: the largest
        value put in ``shared`` (tokens; 0: none), the deepest full-attention depth met."""
        failing, deepest, reach = self._predicted(first, hashes, factor, limit, per, checks, align, ids, hits, shared)
        return [ids[s] for s in failing], deepest, reach

    def _predicted(
        self,
        first: int,
        hashes: list[bytes],
        factor: int,
        limit: int,
        per: int,
        checks: list[Check],
        align: int,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
    ) -> tuple[list[int], int, int]:
        """``predict`` returning the failing slots (not their workers)."""
        failing: list[int] = []
        deepest = reach = 0
        for k, valid, failed in self.walk(first, hashes, factor, limit, per, checks):
            tokens = k * align
            for s in valid:
                hits[ids[s]] = tokens
            if shared is not None:
                reach = max(reach, tokens) if valid or failed else reach
                for s in valid:
                    shared[ids[s]] = tokens
                for s in failed:
                    shared[ids[s]] = tokens
            if failed:
                failing.extend(failed)
                deepest = max(deepest, k)
        return failing, deepest, reach

    def predict_tiered(
        self,
        first: int,
        hashes: list[bytes],
        factor: int,
        limit: int,
        per: int,
        checks: list[Check],
        align: int,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        order: list[Check],
        host: HolderMaps,
        counts: dict[int, int],
        steps: int,
        unit: int,
        prefix: bool,
        host_hits: dict[Hashable, int] | None,
    ) -> tuple[set[Hashable] | None, int, int]:
        """``predict`` then ``tiered`` over the same ``hashes`` (the index's decision with host
        tiers, one call): the failing workers (None: none) as ``tiered``'s ``pending``, which
        loses those it walks, and, with ``prefix``, the failing slots ``counts`` names (the host
        tiers' entry counts per slot) as its ``extra``. Returns what is left of that set (None
        where nothing failed), the deepest failing k (0: none) and ``predict``'s reach over both tiers."""
        failing, deepest, reach = self._predicted(first, hashes, factor, limit, per, checks, align, ids, hits, shared)
        pending = {ids[s] for s in failing} if failing else None
        extra = [s for s in failing if s in counts] if prefix else []
        self.tiered(hashes, order, host, steps, align, unit, prefix, ids, hits, shared, host_hits, pending, extra)
        # ``tiered`` only deepens a depth: the largest value ``shared`` (given empty) holds now
        return pending, deepest, max(shared.values()) if shared and prefix else reach

    # -- the prediction over both tiers -------------------------------------------------------------
    def tiered(
        self,
        hashes: list[bytes],
        order: list[Check],
        host: HolderMaps,
        steps: int,
        align: int,
        unit: int,
        prefix: bool,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        host_hits: dict[Hashable, int] | None,
        pending: set[Hashable] | None,
        extra: list[int],
    ) -> int:
        """The hit over both tiers of every slot that may hit more there: with ``prefix`` (the
        first group is full attention), the slots holding in their host tier (``host``: the host
        tiers' holder maps, of the same kind, group for group) one of the first group's blocks
        within ``steps`` aligned steps of ``align`` tokens, and the slots of ``extra`` (the caller's: those whose device
        hit is below their device depth, which another group's host blocks may lift; any other
        slot's depth over both tiers is its device depth, which its device hit already reaches);
        without, the slots holding any checked group's block there (the checked groups:
        ``order``, ``(group, hash factor, needed ranges)``, first group first). (The compiled
        maps read the first group's host map only where some slot's device run ends, where a
        slot that passes its device depth must hold its next block: they walk fewer slots, each
        met one the same, with the same results.) Per slot, its hit
        is the coordinator's fixed point (``HybridCoordinator.find_longest_cache_hit``
        with a host tier), the longest ``k <= steps`` at which every checked group holds every
        block of its ``ranges[k]`` in either tier; ``prefix``: the first group is full attention
        (its hit is its contiguous depth over both tiers, aligned down). Per such slot, in slot
        order: ``pending`` (if given) loses its worker; ``hits[worker]`` is set to the hit's
        tokens (dropped at 0); ``host_hits`` gets the tokens the host serves where non-zero
        (``host_hit_tokens`` over ``unit``-token positions: those some checked group's needed block
        not on the device covers); ``shared``, with ``prefix``, the aligned depth where non-zero.
        Returns how many slots were met. One walk per slot over the request's blocks in both tiers
        (``PrefixIndex._predict_tiered``; its oracle is ``HitRules.tiered_hit``)."""
        if steps <= 0:
            return 0
        views = [(g, coarse_view(hashes, factor), factor, ranges) for g, factor, ranges in order]
        met: set[int] = set()
        for g, view, factor, _ in views[:1] if prefix else views:
            if host.size(g):
                for key in view[: (steps * align) // (factor * unit)]:
                    met.update(host.holders(g, key))
        met.update(extra)
        for slot in sorted(met):
            worker = ids[slot]

            def held(g: int, key: bytes, slot: int = slot) -> bool:
                return _level_of(self._owners[g].get(key), slot) is not None or host.level(g, key, slot) is not None

            g0, view0, factor0, _ = views[0]
            top = steps
            if prefix:
                per = align // (factor0 * unit)
                depth, end = 0, min(steps * per, len(view0))
                while depth < end and held(g0, view0[depth]):
                    depth += 1
                top = depth // per
            rest = views[1:] if prefix else views
            k = top
            while k > 0 and not all(
                stop <= len(view) and all(held(g, view[i]) for i in range(*ranges[k]))
                for g, view, _, ranges in rest
                for stop in (ranges[k][1],)
            ):
                k -= 1
            if pending is not None:
                pending.discard(worker)
            if k:
                hits[worker] = k * align
            else:
                hits.pop(worker, None)
            if host_hits is not None and k:
                covered = bytearray(k * align // unit)
                for g, view, factor, ranges in views:
                    for i in range(*ranges[k]):
                        if _level_of(self._owners[g].get(view[i]), slot) is None:
                            covered[i * factor : (i + 1) * factor] = b"\x01" * factor
                if covered.count(1):
                    host_hits[worker] = covered.count(1) * unit
            if shared is not None and prefix and top:
                shared[worker] = top * align
        return len(met)

    @staticmethod
    def _depths(view: list[bytes], limit: int, owners: dict[bytes, Holders]) -> list[tuple[int, set[int]]]:
        """Contiguous depths over ``view[:limit]``: ``(n, slots)`` pairs, the holders whose cached
        run is exactly ``n >= 1`` blocks. The holder set only shrinks along the chain and only
        where the stored holder value changes, so sets are intersected at those points alone
        (equal holder values are one object, a slot's shared code or one shared tuple); when the
        whole run up to the first block nobody holds carries one value, C-level list operations
        settle it."""
        values = list(map(owners.get, view[:limit], repeat(NOBODY)))
        try:
            end = values.index(NOBODY)  # the first block nobody holds (a quick unequal-length compare)
        except ValueError:
            end = min(limit, len(view))
        if end <= 0:
            return []
        first = values[0]
        if values[:end].count(first) == end:  # one holder value all along (the common case)
            return [(end, _slots(first))]
        current = _slots(first)
        stops: list[tuple[int, set[int]]] = []
        last = first
        for i in range(1, end):
            value = values[i]
            if value is last:
                continue
            last = value
            kept = current & _slots(value)
            if len(kept) < len(current):
                stops.append((i, current - kept))
                if not kept:
                    return stops
                current = kept
        stops.append((end, current))
        return stops

    def _serving(self, slots: set[int], hashes: list[bytes], checks: list[Check], k: int) -> set[int]:
        """The holders among ``slots`` that hold, in every group of ``checks``, the blocks a hit
        of ``k`` aligned steps needs (a window cached by the same slots is one shared value,
        recognised by a C-level count; otherwise each distinct value narrows the set)."""
        for g, factor, ranges in checks:
            start, stop = ranges[k]
            needed = hashes[start * factor + factor - 1 : stop * factor : factor]  # coarse_view(...)[start:stop]
            values = list(map(self._owners[g].get, needed, repeat(NOBODY)))
            if not values:
                continue
            first = values[0]
            if values.count(first) != len(values):
                if NOBODY in values:
                    return set()
                for value in set(values):
                    slots = slots.intersection([code >> 2 for code in value])
            else:
                slots = slots.intersection([code >> 2 for code in first])
            if not slots:
                return slots
        return slots

    # -- one holder of one key ----------------------------------------------------------------------
    def _hold(self, group: int, block_hash: bytes, slot: int, level: int) -> None:
        """``slot`` holds ``block_hash`` (at ``level`` if it did not already; a held key keeps its level)."""
        owners = self._owners[group]
        state = self._slots[slot]
        value = owners.get(block_hash)
        if value is None:
            owners[block_hash] = state.alone[level]
        else:
            for code in value:
                if code >> 2 == slot:
                    return
            owners[block_hash] = self._shared(tuple(sorted((*value, state.alone[level][0]))), value)
        state.keys[group].append(block_hash)
        state.listed += 1
        state.num_cached += 1

    def _drop(self, owners: dict[bytes, Holders], block_hash: bytes, slot: int) -> bool:
        """``slot`` no longer holds ``block_hash``; whether it did."""
        value = owners.get(block_hash)
        if value is None:
            return False
        i = next((i for i, code in enumerate(value) if code >> 2 == slot), -1)
        if i < 0:
            return False
        if len(value) == 1:
            del owners[block_hash]
        else:
            owners[block_hash] = self._shared(value[:i] + value[i + 1 :], value)
        self._slots[slot].num_cached -= 1
        return True

    def _relevel(
        self, owners: dict[bytes, Holders], block_hash: bytes, slot: int, level: int, raise_only: bool
    ) -> int | None:
        """Set the level ``slot`` holds ``block_hash`` at (only upwards if ``raise_only``); the
        level it held it at before (None: not held, nothing changes)."""
        value = owners.get(block_hash)
        if value is None:
            return None
        for i, code in enumerate(value):
            if code >> 2 == slot:
                old = code & 3
                if old < level or (old != level and not raise_only):
                    new = (*value[:i], self._slots[slot].alone[level][0], *value[i + 1 :])
                    owners[block_hash] = self._shared(new, value)
                return old
        return None

    def _shared(self, holders: Holders, replaced: Holders) -> Holders:
        """The shared value equal to ``holders``, the new value of a key that held ``replaced``:
        one slot's ``alone`` tuple, or one tuple per distinct holder set in use (counted,
        released with the last key)."""
        if len(replaced) > 1:
            uses = self._tuple_uses[replaced] - 1
            if uses:
                self._tuple_uses[replaced] = uses
            else:
                del self._tuple_uses[replaced], self._tuples[replaced]
        if len(holders) == 1:
            code = holders[0]
            return self._slots[code >> 2].alone[code & 3]
        shared = self._tuples.setdefault(holders, holders)
        self._tuple_uses[shared] = self._tuple_uses.get(shared, 0) + 1
        return shared


def compiled_available() -> bool:
    """Whether the compiled maps (``engine.routing._core``) were built and import."""
    return compiled_core("_core", "HolderMaps", "auto") is not None


def compiled_core(module: str, name: str, core: str | None) -> type | None:
    """The compiled class ``name`` of ``engine.routing.<module>`` where ``core`` asks for it and it
    is built, else None (the caller's pure-Python class): ``core`` "compiled", "python" or "auto"
    (the compiled one when it imports); None reads ``KVFLEET_ROUTING_CORE`` (default "auto").
    "compiled" makes a missing extension an error. The one rule for every compiled routing part."""
    choice = core if core is not None else os.environ.get(CORE_ENV, "auto")
    if choice not in ("auto", "compiled", "python"):
        source = "core" if core is not None else CORE_ENV
        raise ValueError(f"{source}: must be 'auto', 'compiled' or 'python' (got {choice!r})")
    if choice == "python":
        return None
    try:
        found: type = getattr(importlib.import_module(f"engine.routing.{module}"), name)
    except ImportError:
        if choice == "compiled":
            raise
        return None
    return found


def make_holder_maps(num_groups: int, core: str | None = None) -> HolderMaps:
    """The holder maps for ``num_groups`` groups, compiled or not as ``compiled_core`` says."""
    compiled = compiled_core("_core", "HolderMaps", core)
    if compiled is None:
        return PyHolderMaps(num_groups)
    maps: HolderMaps = compiled(num_groups)
    return maps


__all__ = [
    "CORE_ENV",
    "NOBODY",
    "Absorbed",
    "Check",
    "HolderMaps",
    "Holders",
    "PyHolderMaps",
    "Stop",
    "compiled_available",
    "compiled_core",
    "make_holder_maps",
]
