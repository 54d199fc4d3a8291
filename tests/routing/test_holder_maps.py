"""The compiled holder maps (``engine.routing._core``) against the pure-Python ones: the same event
streams (stored, evicted, pinned, unpinned, cleared, offloaded to and dropped from the host tier,
sequence gaps and snapshots, workers removed and re-added) give identical holders, levels,
tables, lost-pin reports and predictions."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
from engine.kv_cache.hashing import block_hashes
from engine.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from engine.routing import PrefixIndex, WorkerSnapshot
from engine.routing.holder_maps import CORE_ENV, PyHolderMaps, compiled_available, make_holder_maps
from tests.routing.helpers import CONFIGS, groups_of, tokens

#: the shared group mixes, and two whose walk starts in a group coarser than the hashes (its view
#: is every second hash), read in place by the maps
SPECS: dict[str, list[KVCacheSpec]] = {
    **CONFIGS,
    "swa4+full8": [SlidingWindowSpec(4, window=9), FullAttentionSpec(8)],
    "full8+swa4+mamba8": [FullAttentionSpec(8), SlidingWindowSpec(4, window=13), MambaSpec(8)],
}


def test_compiled_core_is_active() -> None:
    """The install builds ``_core.c`` (setup.py): the index uses it unless told to use Python."""
    if os.environ.get(CORE_ENV) == "python":
        assert isinstance(PrefixIndex(groups_of(CONFIGS["full+2swa"]))._maps, PyHolderMaps)
        return
    assert compiled_available(), "engine.routing._core is not built: run `python setup.py build_ext --inplace`"
    maps = PrefixIndex(groups_of(CONFIGS["full+2swa"]))._maps
    assert type(maps).__module__ == "engine.routing._core"


def test_core_choice_is_validated() -> None:
    with pytest.raises(ValueError, match="core: must be"):
        make_holder_maps(2, "fast")
    assert isinstance(make_holder_maps(2, "python"), PyHolderMaps)


class Fleet:
    """Workers with chained prompts, whose random events go to a Python and a compiled index."""

    def __init__(self, config: str, seed: int, num_workers: int, num_prompts: int):
        self.groups = groups_of(SPECS[config])
        self.ref = PrefixIndex(self.groups, core="python")
        self.fast = PrefixIndex(self.groups, core="compiled")
        self.rng = random.Random(seed)
        self.names = [f"w{i}" for i in range(num_workers)]
        self.seqs: dict[str, int] = {}
        self.model: dict[str, list[dict[bytes, int]]] = {}
        self.host: dict[str, list[dict[bytes, int]]] = {}  # host tiers (level 0: not tracked)
        self.dropped: dict[str, list[KVEvent]] = {}
        # prompts sharing prefixes: a few roots, each extended several ways
        roots = [tokens(self.rng, self.rng.randrange(8, 120), vocab=50) for _ in range(max(1, num_prompts // 4))]
        self.prompts = []
        for _ in range(num_prompts):
            root = self.rng.choice(roots)
            self.prompts.append(block_hashes(root + tokens(self.rng, self.rng.randrange(0, 60), vocab=50), 4))
        self.views = [self.ref.rules.views(p) for p in self.prompts]
        self.watched: dict[str, dict[tuple[int, bytes], object]] = {}

    def add(self, name: str) -> None:
        for index in (self.ref, self.fast):
            index.add_worker(name)
        self.seqs[name] = 0
        self.model[name] = [{} for _ in self.groups]
        self.host[name] = [{} for _ in self.groups]

    def keys(self, g: int) -> list[bytes]:
        """A stretch of one prompt's view in group ``g`` (usually its start)."""
        view = self.rng.choice(self.views)[g]
        if not view:
            return []
        start = 0 if self.rng.random() < 0.7 else self.rng.randrange(len(view))
        stop = self.rng.randrange(start, len(view)) + 1
        return view[start:stop]

    def step(self) -> None:
        rng = self.rng
        name = rng.choice(self.names)
        if name not in self.seqs:
            self.add(name)
            return
        op = rng.random()
        g = rng.randrange(len(self.groups))
        table = self.model[name][g]
        seq = self.seqs[name] + 1
        event: KVEvent
        if op < 0.45:
            keys = self.keys(g)
            event = BlockStored(seq, g, tuple(keys))
            for key in keys:
                table.setdefault(key, 0)
        elif op < 0.65:
            keys = self.keys(g) if rng.random() < 0.5 else rng.sample(sorted(table), min(len(table), 3))
            event = BlockRemoved(seq, g, tuple(keys))
            for key in keys:
                table.pop(key, None)
        elif op < 0.75:
            keys = self.keys(g)
            explicit = rng.random() < 0.5
            event = BlockPinned(seq, g, tuple(keys), explicit=explicit)
            for key in keys:
                if key in table:
                    table[key] = max(table[key], 2 if explicit else 1)
            if explicit and keys:
                self.watched.setdefault(name, {})[(g, keys[0])] = None
        elif op < 0.85:
            keys = self.keys(g)
            event = BlockUnpinned(seq, g, tuple(keys))
            for key in keys:
                if key in table:
                    table[key] = 0
        elif op < 0.87:
            event = AllBlocksCleared(seq)
            self.model[name] = [{} for _ in self.groups]
            self.host[name] = [{} for _ in self.groups]
        elif op < 0.89:
            keys = self.keys(g)
            event = BlockOffloaded(seq, g, tuple(keys))
            self.host[name][g].update(dict.fromkeys(keys, 0))
        elif op < 0.9:
            keys = self.keys(g)
            event = BlockDropped(seq, g, tuple(keys))
            for key in keys:
                self.host[name][g].pop(key, None)
        elif op < 0.94:
            # a lost event: the next one shows a gap, then a snapshot resyncs
            self.seqs[name] = seq
            gap = BlockStored(seq + 1, g, tuple(self.keys(g)))
            for key in gap.block_hashes:
                table.setdefault(key, 0)
            self.seqs[name] = seq + 1
            outcomes = [index.apply_events(name, [gap]) for index in (self.ref, self.fast)]
            assert outcomes[0] == outcomes[1] and outcomes[0].needs_resync
            snap = WorkerSnapshot(
                seq + 1, tuple(dict(t) for t in self.model[name]), tuple(dict(t) for t in self.host[name])
            )
            assert self.ref.apply_snapshot(name, snap) == self.fast.apply_snapshot(name, snap)
            return
        elif op < 0.97:
            for index in (self.ref, self.fast):
                index.remove_worker(name)
            del self.seqs[name], self.model[name], self.host[name]
            self.watched.pop(name, None)
            return
        else:
            return
        self.seqs[name] = seq
        watched = self.watched.get(name)
        outcomes = [index.apply_events(name, [event], watched) for index in (self.ref, self.fast)]
        assert outcomes[0] == outcomes[1], (event, outcomes)

    def check_state(self) -> None:
        for name in self.seqs:
            assert self.fast.tables(name) == self.ref.tables(name) == self.model[name]
            assert self.fast.host_tables(name) == self.ref.host_tables(name) == self.host[name]
            assert self.fast.num_cached(name) == self.ref.num_cached(name)
            assert self.fast.slot_of(name) == self.ref.slot_of(name)
        for views in self.views[:6]:
            for g, view in enumerate(views):
                for key in view[:8]:
                    assert self.fast.holders(g, key) == self.ref.holders(g, key)

    def check_predictions(self) -> int:
        """Both indexes predict the same for every prompt; the number of non-zero predictions."""
        found = 0
        for hashes in self.prompts:
            n = len(hashes) * 4 + self.rng.randrange(0, 4)
            for skip_mamba in (False, True):
                shared_ref: dict[object, int] = {}
                shared_fast: dict[object, int] = {}
                host_ref: dict[object, int] = {}
                host_fast: dict[object, int] = {}
                hits_ref, pending_ref, reach_ref = self.ref.predict_partial(
                    hashes, n - 1, skip_mamba, shared_ref, host_ref
                )
                hits_fast, pending_fast, reach_fast = self.fast.predict_partial(
                    hashes, n - 1, skip_mamba, shared_fast, host_fast
                )
                assert hits_fast == hits_ref and shared_fast == shared_ref and host_fast == host_ref
                assert reach_fast == reach_ref == max(shared_ref.values(), default=0)
                assert (pending_ref is None) == (pending_fast is None)
                if pending_ref is not None and pending_fast is not None:
                    assert pending_ref.workers == pending_fast.workers and pending_ref.length == pending_fast.length
                    self.ref.resolve(pending_ref, hits_ref)
                    self.fast.resolve(pending_fast, hits_fast)
                    assert hits_fast == hits_ref
                for name in self.seqs:  # the reference: the coordinator's own fixed point
                    want = self.ref.rules.tiered_hit(
                        self.model[name], self.host[name], hashes, n - 1, skip_mamba
                    ).tokens
                    assert hits_fast.get(name, 0) == want
                found += bool(hits_ref)
        return found


needs_compiled = pytest.mark.skipif(not compiled_available(), reason="engine.routing._core is not built")


@needs_compiled
@pytest.mark.parametrize("config", sorted(SPECS))
def test_compiled_maps_match_python_under_random_events(config: str) -> None:
    fleet = Fleet(config, seed=len(config), num_workers=10, num_prompts=24)
    found = 0
    for step in range(1500):
        fleet.step()
        if step % 100 == 99:
            fleet.check_state()
            found += fleet.check_predictions()
    assert found >= 10  # the streams do give hits


@needs_compiled
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), workers=st.integers(1, 6), config=st.sampled_from(sorted(SPECS)))
def test_compiled_maps_match_python_hypothesis(seed: int, workers: int, config: str) -> None:
    fleet = Fleet(config, seed=seed, num_workers=workers, num_prompts=8)
    for _ in range(120):
        fleet.step()
    fleet.check_state()
    fleet.check_predictions()


@needs_compiled
def test_compiled_maps_keys_of_any_length_and_slot_reuse() -> None:
    """Hashes that are not 32 bytes are kept by reference; a freed slot is reused empty."""
    index = PrefixIndex(groups_of(CONFIGS["full+2swa"]), core="compiled")
    index.add_worker("a")
    index.add_worker("b")
    keys = (b"x", b"y" * 40, bytes(32))
    index.apply_events("a", [BlockStored(1, 0, keys)])
    index.apply_events("b", [BlockStored(1, 0, keys[:2])])
    assert index.tables("a")[0] == dict.fromkeys(keys, 0)
    assert index.holders(0, b"y" * 40) == ["a", "b"]
    index.remove_worker("a")
    assert index.holders(0, b"y" * 40) == ["b"] and index.holders(0, bytes(32)) == []
    index.add_worker("c")
    assert index.slot_of("c") == 0 and index.num_cached("c") == 0 and index.tables("c")[0] == {}
    with pytest.raises(TypeError, match="block hash: expected bytes"):
        index.apply_events("b", [BlockStored(2, 0, ("text",))])  # type: ignore[arg-type]
