"""The worker coordinator's hit rules over arbitrary per-group hash sets (``HitRules``), and the
snapshot a worker sends when the router resyncs its index (``WorkerSnapshot``).

Split out of ``engine.routing.index`` (which uses both); see that module's docstring for how the
index predicts every worker's hit at once with these rules.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.kv_cache.attention_managers import FullAttentionManager
from engine.kv_cache.coordinator import HybridCoordinator
from engine.kv_cache.host_tier import host_hit_tokens
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.manager_base import SingleTypeManager
from engine.kv_cache.spec import KVCacheGroup

WorkerId = Hashable
GroupHash = tuple[int, bytes]

PREFIX = 0  # a group's hit at L needs every block before L
GENERIC = -1  # needed ranges of no simpler shape: answered range by range


@dataclass(frozen=True)
class WorkerSnapshot:
    """A worker's prefix-cache state: per group, every cached hash and its pin level, as of the
    pool's event sequence number ``seq`` (events with seq <= ``seq`` are already reflected);
    ``host``: the same of its host tier (empty, or one empty dict per group: no host tier)."""

    seq: int
    groups: tuple[dict[bytes, int], ...]
    host: tuple[dict[bytes, int], ...] = ()


def snapshot_coordinator(coord: HybridCoordinator) -> WorkerSnapshot:
    """The snapshot a worker returns when the router asks for a resync (runs on the worker)."""
    seq, groups, host = coord.snapshot()
    return WorkerSnapshot(seq, groups, host)


class TieredHit(NamedTuple):
    """A hit over both tiers: its tokens, the part of them served from the host tier
    (``engine.kv_cache.host_tier.host_hit_tokens``), and the first checked group's depth (the
    coordinator's ``CacheHit.shared_prefix_tokens``)."""

    tokens: int
    host_tokens: int
    shared: int


class WalkPlan(NamedTuple):
    """What the index's walk (``HolderMaps.predict``) needs of the rules, fixed by the groups:
    the first checked group (full attention first), its hash factor (its view of the request's
    hashes is every ``factor``-th one: ``coarse_view``) and blocks per aligned step, and every
    other checked group as ``(group, hash factor, needed ranges)``; the ranges are the live
    lists ``HitRules.ensure`` extends, so one plan serves every request. ``order``: every checked
    group that way, the first included (what the tiered walk, ``HolderMaps.tiered``, reads), and
    ``prefix``: whether the first is a full-attention group (its hits are downward closed)."""

    first: int
    factor: int
    per: int
    checks: list[tuple[int, int, list[tuple[int, int]]]]
    order: list[tuple[int, int, list[tuple[int, int]]]]
    prefix: bool


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
        self.full_set = set(self.full_groups)
        self.order = self.full_groups + [g for g in range(len(self.managers)) if g not in self.full_set]
        # Per group, the needed block range at each aligned length k * alignment, and its shape.
        self._ranges: list[list[tuple[int, int]]] = [[(0, 0)] for _ in self.managers]
        self.shapes: list[int] = [PREFIX for _ in self.managers]
        # The walk's plan without and with skip_mamba (index 0 and 1; None: no group is checked).
        self.walk_plans = (self._walk_plan(False), self._walk_plan(True))

    def _walk_plan(self, skip_mamba: bool) -> WalkPlan | None:
        checked = [g for g in self.order if not (skip_mamba and g in self.mamba_groups)]
        if not checked:
            return None
        first, factors = checked[0], [m.hash_factor for m in self.managers]
        per = self.alignment // self.block_sizes[first]
        order = [(g, factors[g], self._ranges[g]) for g in checked]
        return WalkPlan(first, factors[first], per, order[1:], order, first in self.full_set)

    def ensure(self, steps: int) -> None:
        """Know ``blocks_needed_at(k * alignment)`` for k <= steps in every group, classified as
        PREFIX (blocks 0..end: full attention), a window of ``w >= 1`` blocks ending at the hit
        (fewer near the start: sliding window, Mamba with w = 1) or GENERIC (anything else)."""
        if len(self._ranges[0]) > steps:
            return
        for g, manager in enumerate(self.managers):
            ranges = self._ranges[g]
            shape = self.shapes[g]
            for k in range(len(ranges), steps + 1):
                needed = manager.blocks_needed_at(k * self.alignment)
                start, stop = needed.start, needed.stop
                ranges.append((start, stop))
                if shape == GENERIC:
                    continue
                if stop != k * self.alignment // manager.block_size:
                    shape = GENERIC  # not a range ending at the hit
                elif shape == PREFIX:
                    if start == 0:
                        continue
                    width = stop - start
                    if all(a == max(0, b - width) for a, b in ranges):
                        shape = width
                    else:
                        shape = GENERIC
                elif start != max(0, stop - shape):
                    shape = GENERIC
            self.shapes[g] = shape

    def needed_ranges(self, g: int, steps: int) -> list[tuple[int, int]]:
        self.ensure(steps)
        return self._ranges[g][: steps + 1]

    def views(self, hashes: Sequence[bytes]) -> list[list[bytes]]:
        """The request's hashes at each group's granularity."""
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        return [m.view(hashes) for m in self.managers]

    def longest_hit(
        self,
        tables: Sequence[Mapping[bytes, object]],
        hashes: Sequence[bytes],
        max_length: int,
        skip_mamba: bool,
        host_tables: Sequence[Mapping[bytes, object]] | None = None,
    ) -> int:
        """The coordinator's own fixed point, evaluated on these per-group hash sets (and, given
        ``host_tables``, a host tier's: a needed block may be in either)."""
        if host_tables is not None:
            return self.tiered_hit(tables, host_tables, hashes, max_length, skip_mamba).tokens
        for manager, table in zip(self.managers, tables, strict=True):
            manager.cached = table  # type: ignore[assignment]  # the shadow managers only test membership
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        return self._shadow.find_longest_cache_hit(hashes, max_length, skip_mamba).num_tokens

    def tiered_hit(
        self,
        tables: Sequence[Mapping[bytes, object]],
        host_tables: Sequence[Mapping[bytes, object]],
        hashes: Sequence[bytes],
        max_length: int,
        skip_mamba: bool,
    ) -> TieredHit:
        """The coordinator's fixed point over both tiers (a group serves a length when each block
        its rule needs is in the device table or the host table, as ``find_longest_cache_hit``
        with a host tier), and the tokens of that hit the host serves (device first, as the
        coordinator takes a block from the device where it has one)."""
        for manager, device, hosted in zip(self.managers, tables, host_tables, strict=True):
            manager.cached = ChainMap(device, hosted)  # type: ignore[assignment,arg-type]  # membership only
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        hit = self._shadow.find_longest_cache_hit(hashes, max_length, skip_mamba)
        length = hit.num_tokens
        if not length:
            return TieredHit(0, 0, hit.shared_prefix_tokens)
        found: list[tuple[int, int]] = []
        for g, manager in enumerate(self.managers):
            if skip_mamba and g in self.mamba_groups:
                continue
            view = manager.view(hashes)
            device = tables[g]
            size = manager.block_size
            found.extend((i, size) for i in manager.blocks_needed_at(length) if view[i] not in device)
        host = host_hit_tokens(length, self.hash_block_size, found) if found else 0
        return TieredHit(length, host, hit.shared_prefix_tokens)

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
