"""How ``PrefixIndex`` predicts every worker's hit at once (steps 1-3 of ``engine.routing.index``'s
docstring): ``predict`` / ``predict_partial`` / ``resolve`` and the bulk resolution behind them,
plus ``Pending``, the workers whose hit is still below their full-attention depth.

Split out of ``engine.routing.index``: ``HitPrediction`` is a mixin of ``PrefixIndex`` and owns
no state; it reads the index's ``rules``, ``_owners`` and ``all_mask`` and calls its
``workers_in`` and ``hit``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import accumulate, repeat
from operator import and_

from engine.routing.hit_rules import PREFIX
from engine.routing.worker_masks import RangeAnd, contiguous_depths, sliding_and

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


class HitPrediction:
    """The ``PrefixIndex`` methods that predict hits (mixin, no state of its own).

    Invariants: a prediction for a worker equals what its coordinator's ``find_longest_cache_hit``
    would return on the index's view of its cache (``HitRules.longest_hit``, the reference path);
    only non-zero hits are reported, each a multiple of ``rules.alignment`` and <= ``max_length``;
    only workers in ``all_mask`` (and in ``mask`` when given) are considered; ``Pending.workers``
    only loses workers as ``resolve`` settles them. Reads the index's ``_owners`` (hash -> worker
    bitmask per group), never writes it.
    """

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
        return hits, Pending(failing, deepest - 1, views, [g0] + checks, hashes, skip_mamba)

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

    def _resolve(self, workers: int, steps: int, views: list[list[bytes]], groups: list[int],
                 hits: dict[WorkerId, int]) -> None:  # fmt: skip
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
            serving = ends if serving is None else [a & b for a, b in zip(serving, ends)]
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
