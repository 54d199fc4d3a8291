"""``HostMaps`` on both kinds of holder maps (the compiled table of ``_core.c`` and
``PyHolderMaps``): random offloads, drops, clears and snapshot loads leave both with the same
entries, per-slot counts and total, and both equal a plain reference (a set of (slot, group,
hash) triples)."""

from __future__ import annotations

import random

import pytest

from engine.routing.holder_maps import compiled_available, make_holder_maps
from engine.routing.host_maps import HostMaps

needs_compiled = pytest.mark.skipif(not compiled_available(), reason="engine.routing._core is not built")

GROUPS = 3


@needs_compiled
@pytest.mark.parametrize("seed", range(4))
def test_host_maps_agree_on_both_kinds_and_with_a_reference(seed: int) -> None:
    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(60)] + [b"short-key", b"another"]
    maps = [HostMaps(GROUPS, make_holder_maps(GROUPS, kind)) for kind in ("python", "compiled")]
    held: set[tuple[int, int, bytes]] = set()
    slots = range(6)
    for _ in range(400):
        op = rng.random()
        slot, group = rng.choice(slots), rng.randrange(GROUPS)
        batch = rng.sample(keys, rng.randrange(1, 8))
        if op < 0.5:
            for host in maps:
                host.add(slot, group, batch)
            held |= {(slot, group, key) for key in batch}
        elif op < 0.85:
            for host in maps:
                host.drop(slot, group, batch)
            held -= {(slot, group, key) for key in batch}
        elif op < 0.93:
            for host in maps:
                host.clear(slot)
            held = {t for t in held if t[0] != slot}
        else:
            tables = [{key: 0 for key in rng.sample(keys, rng.randrange(4))} for _ in range(GROUPS)]
            for host in maps:
                host.load(slot, tables)
            held = {t for t in held if t[0] != slot} | {(slot, g, k) for g, t in enumerate(tables) for k in t}
        for host in maps:
            counts = {s: sum(1 for t in held if t[0] == s) for s in slots}
            assert host.counts == {s: n for s, n in counts.items() if n}
            assert host.total == len(held)
            for s in slots:
                assert host.count(s) == counts[s]
                for g in range(GROUPS):
                    for key in rng.sample(keys, 5):
                        assert host.holds(s, g, key) == ((s, g, key) in held)
        probe = rng.choice(slots)
        views = [[dict(view.items()) for view in host.views(probe)] for host in maps]
        assert views[0] == views[1] == [{k: 0 for s, g2, k in held if s == probe and g2 == g} for g in range(GROUPS)]
