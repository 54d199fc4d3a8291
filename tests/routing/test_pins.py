"""Cluster pins against real coordinators: placement on r holders, capacity, TTL, unpin, routing
to holders, re-establishment after eviction and worker loss, automatic pinning."""

from __future__ import annotations

import pytest

from engine.kv_cache.block_queue import TIER_EXPLICIT
from engine.kv_cache.hashing import block_hashes
from engine.routing import (
    PinCapacityError,
    PinOn,
    RouteRequest,
    RoutingPolicy,
    Unpin,
    WorkerLoad,
    snapshot_coordinator,
)
from engine.routing.types import Action
from tests.routing.helpers import (
    CONFIGS,
    Worker,
    execute,
    groups_of,
    router_config,
    sync,
)

SPECS = CONFIGS["full+2swa"]  # block size 4; windows 9 and 17 -> 2 and 4 blocks per hit
PREFIX = list(range(100, 140))  # 40 tokens: 10 full blocks + 2 + 4 window blocks = 16 per replica


def cluster(n: int = 3, num_blocks: int = 96, **kwargs: object) -> tuple[RoutingPolicy, dict[str, Worker]]:
    policy = RoutingPolicy(groups_of(SPECS), router_config(**kwargs))  # type: ignore[arg-type]
    workers = {f"w{i}": Worker(f"w{i}", SPECS, num_blocks) for i in range(n)}
    for name in workers:
        policy.add_worker(name, num_blocks=num_blocks)
    return policy, workers


def explicit_pins(worker: Worker) -> int:
    return sum(1 for b in worker.coord.pool.blocks if b.tier == TIER_EXPLICIT)


def holders(policy: RoutingPolicy, pin_id: int) -> list[str]:
    [info] = [p for p in policy.pin_info() if p.pin_id == pin_id]
    return sorted(str(w) for w in info.active)


def test_pin_is_made_resident_on_r_holders() -> None:
    policy, workers = cluster()
    pin_id, actions = policy.pin(PREFIX, replicas=2)
    assert [type(a) for a in actions] == [PinOn, PinOn]
    assert len({a.worker for a in actions}) == 2
    execute(policy, workers, actions)
    active = holders(policy, pin_id)
    assert len(active) == 2
    for name in active:
        assert explicit_pins(workers[name]) == 16
        hashes = block_hashes([*PREFIX, 1, 2], 4)
        assert workers[name].actual_hit([*PREFIX, 1, 2]) == 40
        assert policy.index.predict(hashes, 41)[name] == 40
    [info] = policy.pin_info()
    assert info.blocks_per_replica == 16 and policy.pins.used_blocks == 32


def test_capacity_is_enforced_with_a_clear_error_and_released_on_unpin() -> None:
    policy, workers = cluster(pin_capacity_blocks=40)
    pin_id, actions = policy.pin(PREFIX, replicas=2)  # 32 blocks
    execute(policy, workers, actions)
    with pytest.raises(PinCapacityError, match=r"needs 16 blocks .* 32 of the cluster pin capacity 40 .* 8 left"):
        policy.pin(list(range(500, 540)), replicas=1)
    execute(policy, workers, policy.unpin(pin_id))
    assert policy.pins.used_blocks == 0
    assert all(explicit_pins(w) == 0 for w in workers.values())
    policy.pin(list(range(500, 540)), replicas=2)  # fits again
    with pytest.raises(ValueError, match="replicas=4"):
        policy.pin(PREFIX, replicas=4)


def test_ttl_expiry_unpins_everywhere() -> None:
    policy, workers = cluster()
    _pin_id, actions = policy.pin(PREFIX, replicas=2, ttl_s=10.0, now=0.0)
    execute(policy, workers, actions)
    assert not [a for a in policy.tick(5.0) if isinstance(a, Unpin)]
    expired = policy.tick(10.5)
    assert sorted(str(a.worker) for a in expired if isinstance(a, Unpin)) == holders_before(actions)
    execute(policy, workers, expired)
    assert policy.pin_info() == [] and all(explicit_pins(w) == 0 for w in workers.values())
    assert all(not w.coord.pins.records for w in workers.values())


def holders_before(actions: list[Action]) -> list[str]:
    return sorted(str(a.worker) for a in actions if isinstance(a, PinOn))


def test_requests_with_a_pinned_prefix_go_to_a_holder() -> None:
    policy, workers = cluster(num_blocks=256)
    prefix = list(range(1000, 1200))  # 200 tokens
    pin_id, actions = policy.pin(prefix, replicas=1)
    execute(policy, workers, actions)
    [holder] = holders(policy, pin_id)
    policy.update_load(holder, WorkerLoad(queued_tokens=2000, running_requests=0))
    prompt = [*prefix, 7, 8, 9]
    decision = policy.route(RouteRequest("r", block_hashes(prompt, 4), len(prompt)))
    assert decision.prefill_worker == holder and decision.reason == "pin" and decision.pin_id == pin_id
    no_pin = RoutingPolicy(groups_of(SPECS))  # same state without the pin preference: cost says idle worker
    for name, w in workers.items():
        no_pin.add_worker(name, snapshot=snapshot_coordinator(w.coord))
    no_pin.update_load(holder, WorkerLoad(queued_tokens=2000, running_requests=0))
    assert no_pin.route(RouteRequest("r", block_hashes(prompt, 4), len(prompt))).prefill_worker != holder


def test_pin_is_re_established_when_a_holder_demotes_it() -> None:
    policy, workers = cluster(num_blocks=48)
    pin_id, actions = policy.pin(PREFIX, replicas=1)
    execute(policy, workers, actions)
    [holder] = holders(policy, pin_id)
    # Memory pressure on the holder: a long request takes every free block, pinned ones demoted.
    big = list(range(5000, 5000 + 4 * 12))  # 36 blocks; 31 free besides the 16 pinned
    assert workers[holder].run(big) is not None
    follow = execute(policy, workers, sync(policy, workers))
    assert any(isinstance(a, Unpin) and a.worker == holder for a in follow)
    [new] = [a.worker for a in follow if isinstance(a, PinOn)]
    assert new != holder
    assert holders(policy, pin_id) == [new]
    assert explicit_pins(workers[str(new)]) == 16
    assert policy.pins.recoveries and policy.pins.recoveries[-1][0] == pin_id


def test_a_host_tier_pin_lives_in_the_host_tier_and_survives_device_pressure() -> None:
    """A host-tier pin: each holder keeps it in its host tier only (no device block pinned), the
    router reports that per holder, device pressure on the holder does not make the router drop
    it, its hit comes back from the host tier, and unpin releases it there."""
    policy = RoutingPolicy(groups_of(SPECS), router_config())
    workers = {f"w{i}": Worker(f"w{i}", SPECS, 48, host_blocks=40) for i in range(2)}
    for name in workers:
        policy.add_worker(name, num_blocks=48)
    pin_id, actions = policy.pin(PREFIX, replicas=1, tier="host")
    assert [(type(a), a.tier) for a in actions] == [(PinOn, "host")]  # type: ignore[union-attr]
    execute(policy, workers, actions)
    [holder] = holders(policy, pin_id)
    [info] = policy.pin_info()
    assert info.tier == "host"
    worker = workers[holder]
    host = worker.coord.host
    assert host is not None
    assert explicit_pins(worker) == 0
    assert sum(1 for b in host.pools[0].blocks if b.tier == TIER_EXPLICIT) == 16
    big = list(range(5000, 5000 + 4 * 12))  # pressure: every free device block taken
    assert worker.run(big) is not None
    follow = execute(policy, workers, sync(policy, workers))
    assert not any(isinstance(a, (Unpin, PinOn)) for a in follow)
    assert holders(policy, pin_id) == [holder]
    hashes = block_hashes(PREFIX, 4)
    assert worker.coord.find_longest_cache_hit(hashes, 40, include_host=False).num_tokens < 40
    assert worker.actual_hit([*PREFIX, 1]) == 40  # with the host tier
    unpin = policy.unpin(pin_id)
    assert [(type(a), a.worker, a.tier) for a in unpin] == [(Unpin, holder, "host")]  # type: ignore[union-attr]
    execute(policy, workers, unpin)
    assert not any(b.tier == TIER_EXPLICIT for b in host.pools[0].blocks)
    worker.coord.check_invariants()


def test_pin_is_re_established_when_a_holder_disappears() -> None:
    policy, workers = cluster()
    pin_id, actions = policy.pin(PREFIX, replicas=2, now=0.0)
    execute(policy, workers, actions)
    lost = holders(policy, pin_id)[0]
    gone = workers.pop(lost)
    follow = policy.remove_worker(lost, now=5.0)
    assert [type(a) for a in follow] == [PinOn] and follow[0].worker not in (lost,)
    assert follow[0].source is not None  # a surviving holder can serve a copy
    execute(policy, workers, follow, now=7.0)
    assert len(holders(policy, pin_id)) == 2 and lost not in holders(policy, pin_id)
    assert policy.pins.recoveries[-1] == (pin_id, 5.0, 7.0)
    assert gone.coord.pins.records  # the dead worker was not contacted


def test_pin_by_hashes_only_uses_workers_that_already_hold_it() -> None:
    policy, workers = cluster()
    workers["w1"].run([*PREFIX, 1])
    workers["w1"].finish_all()
    sync(policy, workers)
    pin_id, actions = policy.pin(block_hashes=block_hashes(PREFIX, 4), num_tokens=40, replicas=2)
    assert [a.worker for a in actions] == ["w1"]  # nobody else could build it
    execute(policy, workers, actions)
    assert holders(policy, pin_id) == ["w1"]


def test_a_short_pin_result_is_undone_and_retried_elsewhere() -> None:
    policy, _workers = cluster()
    pin_id, actions = policy.pin(PREFIX, replicas=1, now=0.0)
    [first] = actions
    follow = policy.pin_result(first.worker, pin_id, 20, now=1.0)  # the worker only had half
    assert isinstance(follow[0], Unpin) and follow[0].worker == first.worker
    assert isinstance(follow[1], PinOn) and follow[1].worker != first.worker


def test_auto_pin_pins_the_hottest_prefixes_within_budget() -> None:
    policy, workers = cluster(auto_pin=True, auto_pin_budget_blocks=20, auto_pin_min_requests=3)
    hot = list(range(2000, 2040))
    warm = list(range(3000, 3040))

    def send(prefix: list[int], n: int, base: int, now: float) -> None:
        """Route each request and run it where it was placed (so its prefix is resident there)."""
        for i in range(n):
            prompt = [*prefix, base + i, 1, 2, 3]
            decision = policy.route(RouteRequest(f"r{base + i}", block_hashes(prompt, 4), len(prompt)), now)
            worker = workers[str(decision.prefill_worker)]
            worker.run(prompt)
            worker.finish(worker.last_id)
            execute(policy, workers, sync(policy, workers, now), now)

    send(hot, 8, 0, 1.0)
    send(warm, 3, 100, 1.0)
    actions = policy.tick(2.0)
    pins = [a for a in actions if isinstance(a, PinOn)]
    assert len(pins) == 1 and pins[0].num_tokens == 40
    # automatic pins keep resident what a worker holds: the holder has the prefix, nothing is computed
    assert workers[str(pins[0].worker)].actual_hit([*hot, 9]) == 40 and pins[0].token_ids is None
    execute(policy, workers, actions, now=2.0)
    assert len(policy.pin_info()) == 1 and policy.pin_info()[0].auto
    # Traffic moves to the other prefix; the old one cools down and is replaced.
    for t in range(1, 8):
        send(warm, 10, 1000 * t, 2.0 + 40 * t)
        execute(policy, workers, policy.tick(2.5 + 40 * t), now=2.5 + 40 * t)
    [info] = policy.pin_info()
    expected = block_hashes(warm, 4)[-1]
    assert policy.pins.pins[info.pin_id].key == expected and len(info.active) == 1


def test_auto_pins_do_not_force_placement_and_give_way_to_explicit_pins() -> None:
    policy, workers = cluster(n=2, num_blocks=96, auto_pin=True, auto_pin_budget_blocks=1000, auto_pin_min_requests=2)
    prompt = [*PREFIX, 7, 1, 2, 3]
    for i in range(3):
        decision = policy.route(RouteRequest(f"r{i}", block_hashes(prompt, 4), len(prompt)), float(i))
        worker = workers[str(decision.prefill_worker)]
        worker.run(prompt)
        worker.finish(worker.last_id)
        execute(policy, workers, sync(policy, workers, float(i)), float(i))
    execute(policy, workers, policy.tick(5.0), now=5.0)
    [auto] = policy.pin_info()
    assert auto.auto and len(auto.active) == 1
    holder = str(auto.active[0])
    other = "w1" if holder == "w0" else "w0"
    # the holder is swamped: an explicit pin would send the request there anyway; an automatic one
    # leaves it to the cost, which picks the idle worker
    policy.update_load(holder, WorkerLoad(queued_tokens=50_000, running_requests=30, used_block_fraction=0.9))
    policy.update_load(other, WorkerLoad())
    decision = policy.route(RouteRequest("after", block_hashes(prompt, 4), len(prompt)), 6.0)
    assert decision.prefill_worker == other
    # per-worker pin room: an explicit pin does not count automatic pins against it
    policy.config = policy.config.model_copy(update={"pin_worker_fraction": 16 / 96})  # room for one 16-block pin
    policy.update_load(holder, WorkerLoad())
    _pin_id, actions = policy.pin(list(range(500, 540)), replicas=2, now=7.0)
    assert sorted(str(a.worker) for a in actions) == ["w0", "w1"]


def test_repeated_pressure_losses_back_off() -> None:
    policy, workers = cluster(n=4)
    pin_id, actions = policy.pin(PREFIX, replicas=1, now=0.0)
    execute(policy, workers, actions)

    def demote_holder(now: float) -> list[Action]:
        [holder] = holders(policy, pin_id)
        workers[holder].coord.pool.demote(10_000)  # memory pressure: every pinned block demoted
        return sync(policy, workers, now)

    first = demote_holder(1.0)
    assert [type(a) for a in first] == [Unpin, PinOn]  # the first loss is re-established at once
    execute(policy, workers, first, now=1.0)
    second = demote_holder(2.0)
    assert [type(a) for a in second] == [Unpin]  # a repeated loss backs off (5 s)
    execute(policy, workers, second, now=2.0)
    assert not [a for a in policy.tick(4.0) if isinstance(a, PinOn)]
    retry = [a for a in policy.tick(7.5) if isinstance(a, PinOn)]
    assert len(retry) == 1
    execute(policy, workers, retry, now=7.5)
    assert len(holders(policy, pin_id)) == 1
