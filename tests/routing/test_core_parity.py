"""The compiled routing core (``engine/routing/_core.c``) against the pure-Python one, end to end:
two ``RoutingPolicy`` objects, one on each core (``KVFLEET_ROUTING_CORE``), fed the same random
trace of real workers' KV events, load reports, pins and requests, must return identical
decisions and actions at every step. Aggregated and P/D fleets, every group mix of ``CONFIGS``
(sliding windows, Mamba, chunked local), host tiers with a measured promote cost, explicit pins
and in-flight prefixes (events delivered late, so routed prefixes are announced but unreported).

Also ``HolderMaps.absorb`` (one call for a worker's common events) on both implementations:
where a batch stops (a gap, an event of another kind, a subclass) and what it skips.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockPinned,
    BlockPromoted,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from engine.kv_cache.hashing import block_hashes
from engine.routing import PinOn, RequestSnapshot, RouteRequest, RoutingPolicy, Unpin, WorkerLoad
from engine.routing.holder_maps import CORE_ENV, HolderMaps, PyHolderMaps, compiled_available, make_holder_maps
from engine.routing.index import ABSORBED
from engine.routing.types import Action, Decision, Role
from tests.routing.helpers import CONFIGS, Worker, groups_of, router_config, tokens

needs_compiled = pytest.mark.skipif(not compiled_available(), reason="engine.routing._core is not built")


class Twin:
    """The same policy on the Python core (``ref``) and the compiled core (``fast``): every call
    goes to both and their results must be equal."""

    def __init__(self, specs_name: str, seed: int, monkeypatch: pytest.MonkeyPatch):
        # a low decode-only threshold: with these short prompts, P/D requests also go to prefill workers
        config = router_config(seed=seed, inflight_ttl_s=5.0, decode_only_threshold_tokens=6)
        groups = groups_of(CONFIGS[specs_name])
        monkeypatch.setenv(CORE_ENV, "python")
        self.ref = RoutingPolicy(groups, config)
        monkeypatch.setenv(CORE_ENV, "compiled")
        self.fast = RoutingPolicy(groups, config)
        monkeypatch.delenv(CORE_ENV)
        assert isinstance(self.ref.index._maps, PyHolderMaps)
        assert type(self.fast.index._maps).__module__ == "engine.routing._core"

    def both(self, call: Callable[[RoutingPolicy], object]) -> object:
        a, b = call(self.ref), call(self.fast)
        assert a == b
        return a


class Trace:
    """Real workers driven by the twin's (identical) decisions."""

    def __init__(self, specs_name: str, seed: int, disaggregated: bool, monkeypatch: pytest.MonkeyPatch):
        self.rng = random.Random(seed)
        self.twin = Twin(specs_name, seed, monkeypatch)
        specs = CONFIGS[specs_name]
        roles: list[Role] = ["prefill", "prefill", "decode", "decode"] if disaggregated else ["both"] * 4
        self.workers: dict[str, Worker] = {}
        for i, role in enumerate(roles):
            host = [None, 48, None, 32][i]
            name = f"{role[0]}{i}"
            blocks = self.rng.choice([16, 20] if host else [24, 32, 48])  # host tiers fill up
            self.workers[name] = Worker(name, specs, blocks, host_blocks=host)
            self.twin.both(lambda p, n=name, r=role, b=blocks: p.add_worker(n, r, b))
        self.hbs = self.twin.ref.rules.hash_block_size
        self.prefixes = [tokens(self.rng, self.rng.randrange(4, 48), vocab=6) for _ in range(7)]
        self.prefixes.append(tokens(self.rng, 24, vocab=6))
        self.pins: list[int] = []
        self.decisions: list[Decision] = []
        self.now = 0.0

    def deliver(self) -> list[Action]:
        """Every worker's pending events, the same list to both policies."""
        actions: list[Action] = []
        for name, worker in self.workers.items():
            events = worker.coord.take_events()
            found = self.twin.both(lambda p, n=name, e=events: p.apply_events(n, e, self.now))
            actions.extend(found)  # type: ignore[arg-type]
        return actions

    def execute(self, actions: list[Action]) -> None:
        queue = list(actions)
        while queue:
            action = queue.pop(0)
            worker = self.workers[action.worker]  # type: ignore[index]
            assert not isinstance(action, RequestSnapshot), "no event is lost in this trace"
            if isinstance(action, Unpin):
                worker.coord.unpin_prefix(action.block_hashes, action.num_tokens, action.tier)
                queue.extend(self.deliver())
            elif isinstance(action, PinOn):
                coord = worker.coord
                warm = None
                if coord.find_longest_cache_hit(action.block_hashes, action.num_tokens).num_tokens < action.num_tokens:
                    assert action.token_ids is not None
                    if worker.run([*action.token_ids, 0]) is not None:
                        warm = worker.last_id
                pinned = coord.pin_prefix(action.block_hashes, action.num_tokens, action.tier)
                if warm is not None:
                    worker.finish(warm)
                queue.extend(self.deliver())
                seq = coord.event_seq
                found = self.twin.both(
                    lambda p, a=action, n=pinned, s=seq: p.pin_result(a.worker, a.pin_id, n, self.now, s)
                )
                queue.extend(found)  # type: ignore[arg-type]

    def step(self) -> None:
        rng = self.rng
        self.now += 0.05
        op = rng.random()
        if op < 0.6:
            prompt = rng.choice(self.prefixes) + tokens(rng, rng.randrange(1, 16), vocab=6)
            request = RouteRequest(f"r{len(self.decisions)}", block_hashes(prompt, self.hbs), len(prompt))
            decision = self.twin.both(lambda p: p.route(request, self.now))
            assert isinstance(decision, Decision)
            self.decisions.append(decision)
            for name in {decision.prefill_worker, decision.decode_worker}:
                self.workers[name].run(prompt)  # type: ignore[index]
        elif op < 0.8:
            rng.choice(list(self.workers.values())).finish(rng=rng)
        elif op < 0.9:
            name = rng.choice(sorted(self.workers))
            host = self.workers[name].coord.host is not None
            load = WorkerLoad(rng.uniform(0, 300), rng.randrange(4), rng.random(), 2e-4 if host else 0.0)
            self.twin.both(lambda p: p.update_load(name, load))
        elif op < 0.95 and len(self.pins) < 2:
            prefix = rng.choice([p for p in self.prefixes if len(p) >= 16])  # at least one aligned block
            pin_id, actions = self.twin.both(lambda p: p.pin(prefix, now=self.now))  # type: ignore[misc]
            self.pins.append(pin_id)
            self.execute(actions)
        elif self.pins:
            pin_id = self.pins.pop(0)
            self.execute(self.twin.both(lambda p: p.unpin(pin_id, self.now)))  # type: ignore[arg-type]
        if rng.random() < 0.5:  # late reports: routed prefixes stay in flight meanwhile
            self.execute(self.deliver())
        self.execute(self.twin.both(lambda p: p.tick(self.now)))  # type: ignore[arg-type]


@needs_compiled
@pytest.mark.parametrize("specs_name", sorted(CONFIGS))
@pytest.mark.parametrize("disaggregated", [False, True], ids=["aggregated", "pd"])
def test_compiled_and_python_cores_route_identically(
    specs_name: str, disaggregated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = Trace(specs_name, 7, disaggregated, monkeypatch)
    for _ in range(160):
        trace.step()
    decisions = trace.decisions
    assert len(decisions) > 60
    assert any(d.predicted_hit > 0 for d in decisions)  # prefixes were found
    assert any(d.reason == "pin" for d in decisions) or any(d.pin_id is not None for d in decisions)
    assert any(d.predicted_host_hit > 0 for d in decisions) or disaggregated
    if disaggregated:
        assert any(d.prefill_worker != d.decode_worker for d in decisions)


def _absorb_case(maps: HolderMaps) -> list[tuple[int, int]]:
    """Batches over one event list; returns each (stop index, last_seq) and checks the maps."""
    maps.add_slot(3)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 7  # keys of any length
    events: list[KVEvent] = [
        BlockStored(1, 0, (a, b)),
        BlockStored(1, 0, (c,)),  # a duplicate seq: skipped
        BlockPinned(2, 0, (a,), explicit=False),
        BlockPinned(3, 0, (a, b), explicit=True),
        BlockPinned(4, 0, (a,), explicit=False),  # raises only: a stays explicit
        BlockRemoved(5, 0, (b, c)),
        BlockStored(6, 1, (c,)),
        BlockPromoted(7, 0, (c,)),  # a subclass: not absorbed
        BlockStored(8, 0, (c,)),
        AllBlocksCleared(9),  # another kind
        BlockStored(11, 0, (b,)),  # after a gap
    ]
    stops = [maps.absorb(events, 0, 3, 0, ABSORBED)]
    assert maps.level(0, a, 3) == 2 and maps.level(0, b, 3) is None and maps.level(0, c, 3) is None
    assert maps.level(1, c, 3) == 0
    stops.append(maps.absorb(events, 8, 3, 7, ABSORBED))
    assert maps.level(0, c, 3) == 0
    stops.append(maps.absorb(events, 10, 3, 9, ABSORBED))
    stops.append(maps.absorb(events, 11, 3, 9, ABSORBED))
    assert maps.num_cached(3) == 3
    return stops


@needs_compiled
def test_absorb_stops_where_the_per_event_path_must_take_over() -> None:
    expected = [(7, 6), (9, 8), (10, 9), (11, 9)]
    assert _absorb_case(make_holder_maps(2, "python")) == expected
    assert _absorb_case(make_holder_maps(2, "compiled")) == expected
    with pytest.raises(ValueError, match="group"):
        maps = make_holder_maps(1, "compiled")
        maps.add_slot(0)
        maps.absorb([BlockStored(1, 4, ())], 0, 0, 0, ABSORBED)
