"""The prefix index's host-tier maps: per group, which workers hold a hash in their host tier.

A worker with ``kv_cache.offload`` on keeps the cached blocks its device evicted in host memory
and serves hits from either tier (docs/architecture.md, "The hybrid KV cache": the host tier).
Its ``BlockOffloaded`` / ``BlockDropped`` events (``engine.kv_cache.events``) feed these maps, as
``BlockStored`` / ``BlockRemoved`` feed the device maps of ``engine.routing.index.PrefixIndex``,
which owns one ``HostMaps`` beside its device maps and consults it only for the workers that hold
some of a prompt's blocks in their host tier: a fleet without host tiers never reads it.

The maps are holder maps of the same kind as the index's device maps (``engine.routing.holder_maps``:
the compiled table of ``_core.c``, or the pure-Python reference), every holder at level 0 (the
router does not track pins of the host tier): a host entry costs what a device entry costs (the
hash inline, no Python object kept per block), and the compiled walk over both tiers
(``HolderMaps.tiered``) reads them with the same lookups as the device maps.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from engine.routing.holder_maps import HolderMaps


class HostView(Mapping[bytes, int]):
    """One worker's host tier in one group, read from the maps: hash -> pin level (always 0: the
    router does not track pins of the host tier). What ``HitRules.tiered_hit`` reads."""

    __slots__ = ("_group", "_maps", "_slot")

    def __init__(self, maps: HolderMaps, group: int, slot: int):
        self._maps = maps
        self._group = group
        self._slot = slot

    def __getitem__(self, key: bytes) -> int:
        if key in self:
            return 0
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._maps.level(self._group, key, self._slot) is not None

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._maps.table(self._group, self._slot))

    def __len__(self) -> int:
        return len(self._maps.table(self._group, self._slot))


class HostMaps:
    """Per group: hash -> the slots of the workers holding it in their host tier.

    Invariants: ``maps`` holds, in group ``g``, exactly the (hash, slot) pairs whose worker
    announced the hash for ``g`` by ``BlockOffloaded`` (or a snapshot) and has not dropped it since
    (``BlockDropped``, a cleared cache or a newer snapshot), each at level 0; a slot is in ``maps``
    once it was first given an entry (it stays, emptied, when cleared); ``counts[slot]`` is the
    number of such (group, hash) entries of a slot (absent: none, else ``maps.num_cached(slot)``),
    ``total`` their sum.
    """

    def __init__(self, num_groups: int, maps: HolderMaps):
        """``maps``: empty holder maps of ``num_groups`` groups (the index's kind)."""
        self.num_groups = num_groups
        self.maps = maps
        self.counts: dict[int, int] = {}
        self.total = 0
        self._slots: set[int] = set()  # the slots ``maps`` has

    def count(self, slot: int) -> int:
        return self.counts.get(slot, 0)

    def holds(self, slot: int, group: int, block_hash: bytes) -> bool:
        """Whether ``slot``'s host tier holds ``block_hash`` in ``group``."""
        return slot in self.counts and self.maps.level(group, block_hash, slot) is not None

    def views(self, slot: int) -> list[HostView]:
        if slot not in self._slots:  # nothing there yet: a view reads an empty slot
            self._slots.add(slot)
            self.maps.add_slot(slot)
        return [HostView(self.maps, group, slot) for group in range(self.num_groups)]

    def add(self, slot: int, group: int, hashes: Sequence[bytes]) -> None:
        maps = self.maps
        if slot not in self._slots:
            self._slots.add(slot)
            maps.add_slot(slot)
        before = maps.num_cached(slot)
        maps.store(group, hashes, slot)
        self._counted(slot, maps.num_cached(slot) - before)

    def drop(self, slot: int, group: int, hashes: Sequence[bytes]) -> None:
        if slot not in self.counts:
            return
        maps = self.maps
        before = maps.num_cached(slot)
        maps.remove(group, hashes, slot, False)
        self._counted(slot, maps.num_cached(slot) - before)

    def clear(self, slot: int) -> None:
        """Forget every host entry of ``slot`` (a walk over the keys it announced)."""
        if slot not in self.counts:
            return
        self.maps.clear(slot)
        self.total -= self.counts.pop(slot)

    def load(self, slot: int, groups: Sequence[Mapping[bytes, int]]) -> None:
        """Replace ``slot``'s host entries by a snapshot's (one dict per group; empty: none)."""
        self.clear(slot)
        for group, table in enumerate(groups):
            if table:
                self.add(slot, group, list(table))

    def _counted(self, slot: int, change: int) -> None:
        if not change:
            return
        count = self.counts.get(slot, 0) + change
        self.total += change
        if count:
            self.counts[slot] = count
        else:
            self.counts.pop(slot, None)
