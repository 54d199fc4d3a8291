"""The prediction over both tiers (``HolderMaps.tiered``: one walk per worker holding some of the
prompt's blocks in its host tier) against its oracle, the coordinator's fixed point over both
tiers on the index's view of each worker (``PrefixIndex.tiered_hit`` / ``hit``), on both cores
(the compiled maps of ``_core.c`` and ``PyHolderMaps``), which must also agree with each other
exactly (hits, host tokens, shared depths and the order the maps wrote them in).

Worker states are random per-group subsets of a few prompt families' blocks in each tier (gaps,
windows missing, blocks only in the host tier, the same block in both), loaded as snapshots, so
the walk meets states no eviction order would produce in a short run; every group mix of
``CONFIGS``, with and without ``skip_mamba``.
"""

from __future__ import annotations

import random

import pytest

from engine.kv_cache.hashing import block_hashes
from engine.routing.hit_rules import HitRules, WalkPlan, WorkerSnapshot
from engine.routing.holder_maps import compiled_available
from engine.routing.index import Pending, PrefixIndex, WorkerId
from tests.routing.helpers import CONFIGS, groups_of, tokens

needs_compiled = pytest.mark.skipif(not compiled_available(), reason="engine.routing._core is not built")

Prediction = tuple[list[tuple[WorkerId, int]], list[tuple[WorkerId, int]], list[tuple[WorkerId, int]]]


def random_tables(rng: random.Random, views: list[list[list[bytes]]], density: float) -> tuple[dict[bytes, int], ...]:
    """Per group, a random subset of the families' blocks: a prefix of each family's view, then
    blocks kept with probability ``density`` (gaps)."""
    out = []
    for g in range(len(views[0])):
        table: dict[bytes, int] = {}
        for family in views:
            view = family[g]
            run = rng.randrange(len(view) + 1)
            for i, key in enumerate(view):
                if i < run or rng.random() < density:
                    table[key] = rng.choice((0, 0, 1, 2))
        out.append(table)
    return tuple(out)


def predict(index: PrefixIndex, hashes: list[bytes], max_length: int, skip_mamba: bool) -> Prediction:
    shared: dict[WorkerId, int] = {}
    host: dict[WorkerId, int] = {}
    hits, pending, reach = index.predict_partial(hashes, max_length, skip_mamba, shared, host)
    assert reach == max(shared.values(), default=0)  # the walk's deepest depth, no second pass
    if pending is not None:
        index.resolve(pending, hits)
    return list(hits.items()), list(shared.items()), list(host.items())


@needs_compiled
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiered_walk_equals_the_fixed_point_on_both_cores(name: str) -> None:
    rng = random.Random(name)
    groups = groups_of(CONFIGS[name])
    indexes = [PrefixIndex(groups, core="python"), PrefixIndex(groups, core="compiled")]
    rules = indexes[0].rules
    hbs = rules.hash_block_size
    met = 0
    for _round in range(6):
        families = [tokens(rng, rng.randrange(hbs, 30 * hbs), vocab=4) for _ in range(3)]
        chains = [block_hashes(f, hbs) for f in families]
        views = [rules.views(chain) for chain in chains]
        snapshots = {}
        for w in range(7):
            device = random_tables(rng, views, rng.choice((0.0, 0.2, 0.6)))
            host = () if w == 0 else random_tables(rng, views, rng.choice((0.0, 0.3, 0.8)))
            if w == 1:
                host = tuple({} for _ in groups)  # a host tier holding nothing
            snapshots[f"w{rng.randrange(10**6)}-{w}"] = WorkerSnapshot(1, device, host)
        for index in indexes:
            for worker in index.workers:
                index.remove_worker(worker)
            for worker, snapshot in snapshots.items():
                index.add_worker(worker, snapshot)
        for _ in range(25):
            family = rng.randrange(len(families))
            prompt = families[family][: rng.randrange(1, len(families[family]) + 1)] + tokens(rng, rng.randrange(6))
            hashes = block_hashes(prompt, hbs)
            max_length = len(prompt) - 1
            skip_mamba = rng.random() < 0.3
            ref, fast = (predict(index, hashes, max_length, skip_mamba) for index in indexes)
            assert ref == fast
            hits, _, host = (dict(part) for part in ref)
            index = indexes[0]
            for worker in snapshots:
                assert hits.get(worker, 0) == index.hit(worker, hashes, max_length, skip_mamba), worker
                if index.host.count(index.slot_of(worker)):
                    found = index.tiered_hit(worker, hashes, max_length, skip_mamba)
                    assert host.get(worker, 0) == found.host_tokens, worker
                    met += found.host_tokens > 0
    assert met > 20  # the host tiers served part of many hits


@needs_compiled
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_tiered_walk_after_the_caches_changed_reads_them_now(name: str) -> None:
    """The compiled tiered walk reads the device entries the last walk over the same hashes met
    (``predict_partial``: the walk, then the tiered walk) only while no entry was made or dropped
    since: a tiered walk over a prompt walked before the workers' caches changed (workers gone,
    others come with other blocks, the freed entries reused) equals the Python maps' on the new
    state."""
    rng = random.Random(f"stale-{name}")
    groups = groups_of(CONFIGS[name])
    indexes = [PrefixIndex(groups, core="python"), PrefixIndex(groups, core="compiled")]
    rules = indexes[0].rules
    hbs = rules.hash_block_size
    compared = 0
    for _round in range(20):
        families = [tokens(rng, rng.randrange(4 * hbs, 30 * hbs), vocab=4) for _ in range(3)]
        views = [rules.views(block_hashes(f, hbs)) for f in families]
        prompt = families[0] + tokens(rng, 3)
        hashes = block_hashes(prompt, hbs)
        before = {
            f"a{w}": WorkerSnapshot(1, random_tables(rng, views[:1], 0.5), random_tables(rng, views, 0.5))
            for w in range(4)
        }
        after = {
            f"b{w}": WorkerSnapshot(1, random_tables(rng, views, 0.5), random_tables(rng, views, 0.5)) for w in range(4)
        }
        for index in indexes:
            for worker in index.workers:
                index.remove_worker(worker)
            for worker, snapshot in before.items():
                index.add_worker(worker, snapshot)
        for index in indexes:
            predict(index, hashes, len(prompt) - 1, False)  # the walk over ``hashes``
        results = []
        for index in indexes:
            for worker in before:
                index.remove_worker(worker)
            for worker, snapshot in after.items():
                index.add_worker(worker, snapshot)
            hits: dict[WorkerId, int] = {}
            shared: dict[WorkerId, int] = {}
            host: dict[WorkerId, int] = {}
            steps = (len(prompt) - 1) // rules.alignment
            rules.ensure(steps)
            plan = rules.walk_plans[0]
            assert plan is not None
            index._predict_tiered(hashes, steps, plan, hits, None, shared, host)
            results.append((list(hits.items()), list(shared.items()), list(host.items())))
        assert results[0] == results[1]
        compared += bool(results[0][0])
    assert compared > 5


def walk_args(index: PrefixIndex, hashes: list[bytes], max_length: int, skip_mamba: bool) -> tuple[WalkPlan, int, int]:
    """The request's walk plan, aligned steps and walk limit, as ``predict_partial`` makes them."""
    rules = index.rules
    steps = max_length // rules.alignment
    rules.ensure(steps)
    plan = rules.walk_plans[1 if skip_mamba else 0]
    assert plan is not None
    limit = min(steps * plan.per, len(hashes) // plan.factor)
    return plan, steps, limit - limit % plan.per


def failing_on_device(index: PrefixIndex, hashes: list[bytes], max_length: int, skip_mamba: bool) -> list[WorkerId]:
    """The workers whose device hit is below their full-attention depth (the walk alone)."""
    plan, _, limit = walk_args(index, hashes, max_length, skip_mamba)
    align = index.rules.alignment
    return index._maps.predict(
        plan.first, hashes, plan.factor, limit, plan.per, plan.checks, align, index._ids, {}, {}
    )[0]


def two_calls(index: PrefixIndex, hashes: list[bytes], max_length: int, skip_mamba: bool) -> tuple[object, ...]:
    """The walk (``HolderMaps.predict``), then the walk over both tiers (``_predict_tiered``), as
    two calls: what ``predict_tiered`` does in one."""
    plan, steps, limit = walk_args(index, hashes, max_length, skip_mamba)
    align = index.rules.alignment
    hits: dict[WorkerId, int] = {}
    shared: dict[WorkerId, int] = {}
    host: dict[WorkerId, int] = {}
    failing, deepest, _ = index._maps.predict(
        plan.first, hashes, plan.factor, limit, plan.per, plan.checks, align, index._ids, hits, shared
    )
    pending = Pending(set(failing), (deepest - 1) * align, hashes, skip_mamba) if failing else None
    index._predict_tiered(hashes, steps, plan, hits, pending, shared, host)
    left = None if pending is None else pending.workers
    reach = max(shared.values(), default=0)  # what ``predict_tiered`` finds without this pass
    return list(hits.items()), list(shared.items()), list(host.items()), left, deepest if failing else 0, reach


def one_call(index: PrefixIndex, hashes: list[bytes], max_length: int, skip_mamba: bool) -> tuple[object, ...]:
    """``HolderMaps.predict_tiered`` on the same request."""
    plan, steps, limit = walk_args(index, hashes, max_length, skip_mamba)
    rules = index.rules
    hits: dict[WorkerId, int] = {}
    shared: dict[WorkerId, int] = {}
    host: dict[WorkerId, int] = {}
    failed, deepest, reach = index._maps.predict_tiered(
        plan.first, hashes, plan.factor, limit, plan.per, plan.checks, rules.alignment, index._ids, hits, shared,
        plan.order, index.host.maps, index.host.counts, steps, rules.hash_block_size, plan.prefix, host,
    )  # fmt: skip
    return list(hits.items()), list(shared.items()), list(host.items()), failed, deepest, reach


@needs_compiled
@pytest.mark.parametrize("name", sorted(name for name in CONFIGS if HitRules(groups_of(CONFIGS[name])).full_groups))
def test_predict_tiered_is_the_walk_then_the_tiered_walk_on_both_cores(name: str) -> None:
    """The one call a decision makes with host tiers (``HolderMaps.predict_tiered``: the walk, the
    failing workers as a set, the failing slots with a host tier walked over both tiers) equals the
    two calls it replaces (``predict``, then ``tiered`` with the pending set and the failing slots
    the host counts name) on each core, and the cores equal each other: hits, shared depths and
    host tokens in the order written, the pending workers left, the deepest failing step."""
    rng = random.Random(f"fused-{name}")
    groups = groups_of(CONFIGS[name])
    indexes = [PrefixIndex(groups, core="python"), PrefixIndex(groups, core="compiled")]
    rules = indexes[0].rules
    hbs = rules.hash_block_size
    pending_met = handed = 0
    for _round in range(6):
        families = [tokens(rng, rng.randrange(hbs, 30 * hbs), vocab=4) for _ in range(3)]
        views = [rules.views(block_hashes(f, hbs)) for f in families]
        snapshots = {}
        for w in range(8):
            device = random_tables(rng, views, rng.choice((0.0, 0.2, 0.6)))
            host = () if w < 2 else random_tables(rng, views, rng.choice((0.0, 0.3, 0.8)))
            snapshots[f"w{w}"] = WorkerSnapshot(1, device, host)
        for index in indexes:
            for worker in index.workers:
                index.remove_worker(worker)
            for worker, snapshot in snapshots.items():
                index.add_worker(worker, snapshot)
        for _ in range(25):
            family = rng.randrange(len(families))
            prompt = families[family][: rng.randrange(1, len(families[family]) + 1)] + tokens(rng, rng.randrange(6))
            hashes = block_hashes(prompt, hbs)
            if (len(prompt) - 1) // rules.alignment <= 0:
                continue
            skip_mamba = rng.random() < 0.3
            results = []
            failing = failing_on_device(indexes[0], hashes, len(prompt) - 1, skip_mamba)
            for index in indexes:
                fused = one_call(index, hashes, len(prompt) - 1, skip_mamba)
                assert fused == two_calls(index, hashes, len(prompt) - 1, skip_mamba)
                results.append(fused)
            assert results[0] == results[1]
            left = results[0][3]
            pending_met += left is not None
            handed += left is not None and len(left) < len(failing)  # type: ignore[arg-type]
    # workers failed their depth; some of them, with a host tier, were walked over both tiers
    assert pending_met > 5 and handed > 2, (pending_met, handed)
