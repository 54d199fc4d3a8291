"""The prefix index: event application, sequence gaps and resync, snapshots, membership, cost."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
)
from engine.kv_cache.hashing import block_hashes
from engine.routing import (
    PrefixIndex,
    RequestSnapshot,
    RoutingPolicy,
    WorkerSnapshot,
    snapshot_coordinator,
)
from engine.routing.holder_maps import PyHolderMaps
from tests.routing.helpers import CONFIGS, Worker, groups_of, sync, tokens

SPECS = CONFIGS["full+2swa"]


def h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_routing_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys, engine.routing;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_events_update_sets_pins_and_holders() -> None:
    index = PrefixIndex(groups_of(SPECS))
    index.add_worker("a")
    index.add_worker("b")
    index.apply_events("a", [BlockStored(1, 0, (h(1), h(2))), BlockStored(2, 1, (h(2),))])
    index.apply_events("b", [BlockStored(1, 0, (h(1),))])
    assert index.cached("a", 0, h(2)) and index.cached("a", 1, h(2)) and not index.cached("b", 0, h(2))
    assert index.holders(0, h(1)) == ["a", "b"] and index.holders(0, h(2)) == ["a"]
    index.apply_events("a", [BlockPinned(3, 0, (h(1),), explicit=False), BlockPinned(4, 0, (h(1),), explicit=True)])
    assert index.pin_level("a", 0, h(1)) == 2
    index.apply_events("a", [BlockUnpinned(5, 0, (h(1),)), BlockRemoved(6, 0, (h(1),))])
    assert index.pin_level("a", 0, h(1)) is None
    assert index.holders(0, h(1)) == ["b"] and index.pin_level("b", 0, h(1)) == 0
    index.apply_events("a", [AllBlocksCleared(7)])
    assert index.num_cached("a") == 0 and index.holders(0, h(2)) == []
    assert index.last_seq("a") == 7
    index.remove_worker("b")
    assert all(index._maps.size(g) == 0 for g in range(3))
    index.add_worker("c")  # reuses b's slot with an empty state
    assert index.num_cached("c") == 0 and index.slot_of("c") == 1


def test_duplicate_events_are_ignored_and_a_gap_asks_for_one_snapshot() -> None:
    index = PrefixIndex(groups_of(SPECS))
    index.add_worker("a")
    assert not index.apply_events("a", [BlockStored(1, 0, (h(1),))]).needs_resync
    assert not index.apply_events("a", [BlockStored(1, 0, (h(1),))]).needs_resync  # replayed: ignored
    outcome = index.apply_events("a", [BlockStored(3, 0, (h(3),)), BlockStored(4, 0, (h(4),))])
    assert outcome.needs_resync and index.is_stale("a")
    assert not index.cached("a", 0, h(3))  # buffered, not applied
    assert not index.apply_events("a", [BlockStored(5, 0, (h(5),))]).needs_resync  # asked once
    # The worker's state as of seq 3 (the lost event 2 stored h(2); 3 stored h(3)).
    snap = WorkerSnapshot(3, ({h(1): 0, h(2): 0, h(3): 0}, {}, {}))
    outcome = index.apply_snapshot("a", snap)
    assert not outcome.needs_resync and not index.is_stale("a")
    assert all(index.cached("a", 0, h(i)) for i in (1, 2, 3, 4, 5))
    assert index.last_seq("a") == 5


def test_snapshot_not_reaching_the_buffer_asks_again() -> None:
    index = PrefixIndex(groups_of(SPECS))
    index.add_worker("a")
    index.apply_events("a", [BlockStored(5, 0, (h(5),))])
    outcome = index.apply_snapshot("a", WorkerSnapshot(2, ({}, {}, {})))  # event 3..4 still missing
    assert outcome.needs_resync and index.is_stale("a")


@pytest.mark.parametrize("name", ["full+2swa", "full+swa8+mamba8"])
def test_resync_after_lost_events_restores_exact_predictions(name: str) -> None:
    """Drop a worker's events on the floor for a while; the gap triggers a RequestSnapshot, and
    the snapshot (plus buffered events) makes predictions exact again."""
    specs = CONFIGS[name]
    rng = random.Random(7)
    workers = {"w0": Worker("w0", specs, 48), "w1": Worker("w1", specs, 48)}
    policy = RoutingPolicy(groups_of(specs))
    for w in workers:
        policy.add_worker(w)
    prefixes = [tokens(rng, rng.randrange(8, 40)) for _ in range(5)]
    requested = []
    for step in range(300):
        worker = workers[rng.choice(sorted(workers))]
        if rng.random() < 0.6:
            worker.run(rng.choice(prefixes) + tokens(rng, rng.randrange(1, 9)))
        else:
            worker.finish(rng=rng)
        if 100 <= step < 140:
            worker.coord.take_events()  # lost in transit
            continue
        actions = sync(policy, workers)
        for action in actions:
            assert isinstance(action, RequestSnapshot)
            requested.append(action.worker)
            policy.apply_snapshot(action.worker, snapshot_coordinator(workers[action.worker].coord))
        if step >= 160:
            query = rng.choice(prefixes) + tokens(rng, 3)
            hashes = block_hashes(query, policy.rules.hash_block_size)
            predicted = policy.index.predict(hashes, len(query) - 1)
            for n, w in workers.items():
                assert predicted.get(n, 0) == w.actual_hit(query), (step, n)
    assert sorted(set(requested)) == ["w0", "w1"]


def test_snapshot_equals_event_replay() -> None:
    rng = random.Random(3)
    worker = Worker("w", SPECS, 40)
    index = PrefixIndex(groups_of(SPECS))
    index.add_worker("live")
    for _ in range(200):
        if rng.random() < 0.6:
            worker.run(tokens(rng, rng.randrange(4, 30), vocab=4))
        else:
            worker.finish(rng=rng)
        if rng.random() < 0.1:
            worker.coord.pin_prefix(block_hashes(tokens(rng, 12, vocab=4), 4), 12)
        index.apply_events("live", worker.coord.take_events())
    snap = snapshot_coordinator(worker.coord)
    assert snap.seq == index.last_seq("live") == worker.coord.event_seq
    assert [dict(t) for t in index.tables("live")] == list(snap.groups)
    index.add_worker("fresh", snap)
    assert index.tables("fresh") == index.tables("live")


def test_coordinator_snapshot_is_a_copy_taken_at_its_event_seq() -> None:
    """The public read-only API the router uses: ``event_seq`` and ``snapshot()``."""
    worker = Worker("w", SPECS, 40)
    assert worker.coord.event_seq == 0 and worker.coord.snapshot() == (0, ({}, {}, {}), ({}, {}, {}))
    worker.run(tokens(random.Random(1), 20, vocab=4))
    events = worker.coord.take_events()
    seq, groups, host = worker.coord.snapshot()
    assert host == ({}, {}, {})  # no host tier
    assert seq == worker.coord.event_seq == events[-1].seq
    stored = {(e.group, h) for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert {(g, h) for g, table in enumerate(groups) for h in table} <= stored
    groups[0].clear()  # a copy: clearing it leaves the pool alone
    assert worker.coord.snapshot()[1][0]


class CountingDict(dict):  # type: ignore[type-arg]
    calls = 0

    def get(self, key, default=None):  # type: ignore[no-untyped-def,override]
        CountingDict.calls += 1
        return super().get(key, default)


def test_prediction_cost_is_independent_of_the_number_of_cached_prefixes() -> None:
    """Lookups per prediction depend on the request's blocks, not on what else is cached (counted
    on the pure-Python holder maps; the compiled ones walk the same keys)."""
    index = PrefixIndex(groups_of(SPECS), core="python")
    maps = index._maps
    assert isinstance(maps, PyHolderMaps)
    for w in range(8):
        index.add_worker(w)
    rng = random.Random(0)
    probe = tokens(rng, 400, vocab=1000)
    probe_hashes = block_hashes(probe, 4)

    def cost() -> int:
        CountingDict.calls = 0
        index.predict(probe_hashes, len(probe) - 1)
        return CountingDict.calls

    def store(worker: int, hashes: list[bytes]) -> None:
        seq = index.last_seq(worker)
        index.apply_events(worker, [BlockStored(seq + 1 + g, g, tuple(hashes)) for g in range(3)])

    for w in range(8):
        store(w, probe_hashes[: 20 * (w + 1)])
    maps._owners = [CountingDict(o) for o in maps._owners]
    small = cost()
    for i in range(3000):  # many other cached prefixes everywhere
        store(i % 8, block_hashes(tokens(rng, 64, vocab=1000), 4))
    maps._owners = [CountingDict(o) for o in maps._owners]
    assert cost() == small
    assert small <= 3 * len(probe_hashes)


def test_holder_sets_match_a_per_worker_model_under_random_events() -> None:
    """Many workers sharing keys: stored, removed, pinned, unpinned, cleared, snapshots and
    removals keep every key's holders and levels equal to a per-worker model, and the prediction
    equal to the coordinator's fixed point on each worker's own tables."""
    rng = random.Random(11)
    index = PrefixIndex(groups_of(SPECS))
    model: dict[str, list[dict[bytes, int]]] = {}
    seqs: dict[str, int] = {}
    keys = [h(i) for i in range(40)]
    names = [f"w{i}" for i in range(12)]
    nonzero = 0
    for step in range(3000):
        name = rng.choice(names)
        if name not in model:
            index.add_worker(name)
            model[name], seqs[name] = [{}, {}, {}], 0
        op = rng.random()
        g = rng.randrange(3)
        chosen = tuple(rng.sample(keys, rng.randrange(1, 6)))
        table = model[name][g]
        seqs[name] += 1
        seq = seqs[name]
        if op < 0.45:
            event = BlockStored(seq, g, chosen)
            for key in chosen:
                table.setdefault(key, 0)
        elif op < 0.7:
            event = BlockRemoved(seq, g, chosen)
            for key in chosen:
                table.pop(key, None)
        elif op < 0.85:
            explicit = rng.random() < 0.5
            event = BlockPinned(seq, g, chosen, explicit=explicit)
            for key in chosen:
                if key in table:
                    table[key] = max(table[key], 2 if explicit else 1)
        elif op < 0.95:
            event = BlockUnpinned(seq, g, chosen)
            for key in chosen:
                if key in table:
                    table[key] = 0
        elif op < 0.97:
            event = AllBlocksCleared(seq)
            model[name] = [{}, {}, {}]
        elif op < 0.99:
            seqs[name] -= 1
            index.apply_snapshot(name, WorkerSnapshot(seq - 1, tuple(dict(t) for t in model[name])))
            continue
        else:
            index.remove_worker(name)
            del model[name], seqs[name]
            continue
        assert not index.apply_events(name, [event]).needs_resync
        if step % 50 == 0:
            for worker, tables in model.items():
                assert index.tables(worker) == tables, (step, worker)
                assert index.num_cached(worker) == sum(map(len, tables))
            for g in range(3):
                for key in keys:
                    expected = sorted((w for w in model if key in model[w][g]), key=index.slot_of)
                    assert index.holders(g, key) == expected
            query = keys[: rng.randrange(1, 40)]
            predicted = index.predict(query, len(query) * 4 - 1)
            for worker, tables in model.items():
                assert predicted.get(worker, 0) == index.rules.longest_hit(tables, query, len(query) * 4 - 1, False)
            nonzero += bool(predicted)
    assert nonzero >= 5  # the random tables do give hits
