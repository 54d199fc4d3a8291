"""The prefix index's host-tier maps: per group, which workers hold a hash in their host tier.

A worker with ``kv_cache.offload`` on keeps the cached blocks its device evicted in host memory
and serves hits from either tier (docs/architecture.md, "The hybrid KV cache": the host tier).
Its ``BlockOffloaded`` / ``BlockDropped`` events (``engine.kv_cache.events``) feed these maps, as
``BlockStored`` / ``BlockRemoved`` feed the device maps of ``engine.routing.index.PrefixIndex``,
which owns one ``HostMaps`` beside its device maps and consults it only for the workers that hold
some of a prompt's blocks in their host tier: a fleet without host tiers never reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

#: a key's holders in the host tier: their slots, increasing (never empty)
Slots = tuple[int, ...]


class HostView(Mapping[bytes, int]):
    """One worker's host tier in one group, read from the maps: hash -> pin level (always 0: the
    router does not track pins of the host tier). What ``HitRules.tiered_hit`` reads."""

    __slots__ = ("_map", "_slot")

    def __init__(self, holders: dict[bytes, Slots], slot: int):
        self._map = holders
        self._slot = slot

    def __getitem__(self, key: bytes) -> int:
        if self._slot in self._map.get(key, ()):
            return 0
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return self._slot in self._map.get(key, ())  # type: ignore[call-overload]

    def __iter__(self) -> Iterator[bytes]:
        slot = self._slot
        return (h for h, slots in self._map.items() if slot in slots)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class HostMaps:
    """Per group: hash -> the slots of the workers holding it in their host tier.

    Invariants: ``maps[g][h]`` lists, in increasing order and never empty, exactly the slots whose
    worker announced ``h`` for group ``g`` by ``BlockOffloaded`` (or a snapshot) and has not
    dropped it since (``BlockDropped``, a cleared cache or a newer snapshot); ``counts[slot]`` is
    the number of such (group, hash) entries of a slot (absent: none), ``total`` their sum, and
    every key a slot holds in group ``g`` is in ``keys[slot][g]`` (which may also list keys it no
    longer holds; compacted as it grows, like the device maps' key lists).
    """

    def __init__(self, num_groups: int):
        self.num_groups = num_groups
        self.maps: list[dict[bytes, Slots]] = [{} for _ in range(num_groups)]
        self.counts: dict[int, int] = {}
        self.keys: dict[int, list[list[bytes]]] = {}
        self.total = 0
        self._alone: dict[int, Slots] = {}  # one shared ``(slot,)`` per slot

    def count(self, slot: int) -> int:
        return self.counts.get(slot, 0)

    def holds(self, slot: int, group: int, block_hash: bytes) -> bool:
        """Whether ``slot``'s host tier holds ``block_hash`` in ``group``."""
        return slot in self.maps[group].get(block_hash, ())

    def views(self, slot: int) -> list[HostView]:
        return [HostView(holders, slot) for holders in self.maps]

    def add(self, slot: int, group: int, hashes: Sequence[bytes]) -> None:
        holders = self.maps[group]
        alone = self._alone.get(slot)
        if alone is None:
            alone = self._alone[slot] = (slot,)
        keys = self.keys.get(slot)
        if keys is None:
            keys = self.keys[slot] = [[] for _ in range(self.num_groups)]
        listed = keys[group]
        added = 0
        for block_hash in hashes:
            value = holders.get(block_hash)
            if value is None:
                holders[block_hash] = alone
            elif slot in value:
                continue
            else:
                holders[block_hash] = tuple(sorted((*value, slot)))
            listed.append(block_hash)
            added += 1
        if added:
            count = self.counts.get(slot, 0) + added
            self.counts[slot] = count
            self.total += added
            if 2 * sum(map(len, keys)) > 3 * count + 128:
                self._compact(slot)

    def drop(self, slot: int, group: int, hashes: Sequence[bytes]) -> None:
        holders = self.maps[group]
        dropped = 0
        for block_hash in hashes:
            value = holders.get(block_hash)
            if value is None or slot not in value:
                continue
            if len(value) == 1:
                del holders[block_hash]
            else:
                holders[block_hash] = tuple(s for s in value if s != slot)
            dropped += 1
        if dropped:
            self._counted(slot, -dropped)

    def clear(self, slot: int) -> None:
        """Forget every host entry of ``slot`` (a walk over the keys it announced)."""
        keys = self.keys.pop(slot, None)
        if keys is None:
            return
        for group, listed in enumerate(keys):
            self.drop(slot, group, listed)
        self.counts.pop(slot, None)

    def load(self, slot: int, groups: Sequence[Mapping[bytes, int]]) -> None:
        """Replace ``slot``'s host entries by a snapshot's (one dict per group; empty: none)."""
        self.clear(slot)
        for group, table in enumerate(groups):
            if table:
                self.add(slot, group, list(table))

    def _counted(self, slot: int, change: int) -> None:
        count = self.counts.get(slot, 0) + change
        self.total += change
        if count:
            self.counts[slot] = count
        else:
            self.counts.pop(slot, None)

    def _compact(self, slot: int) -> None:
        keys = self.keys[slot]
        for group, holders in enumerate(self.maps):
            keys[group] = [h for h in dict.fromkeys(keys[group]) if slot in holders.get(h, ())]
