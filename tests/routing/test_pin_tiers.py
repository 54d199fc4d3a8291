"""Cluster pins across a holder's two tiers: a device-tier pin whose holder's device gives its
blocks up (offloaded into the host tier, still pinned) keeps that holder, which keeps it in its
host tier until a hit promotes it back; a key gone from both tiers loses the holder; a host-tier
pin is verified from the holder's host events rather than taken on its word.

Oracles: the holders' real ``HybridCoordinator`` (the pin tier of its blocks in both tiers, the
hit and host part it serves, ``actual_tiers`` / ``last_hit``) against what the router reports
(``pin_info``'s ``holder_tiers``, the decision's predicted hit per tier, the actions it sends).
"""

from __future__ import annotations

import pytest

from engine.kv_cache.block_queue import TIER_EXPLICIT
from engine.kv_cache.events import BlockDropped
from engine.kv_cache.hashing import block_hashes
from engine.routing import PinOn, RouteRequest, RoutingPolicy, Unpin
from engine.routing.types import Action, PinInfo
from tests.routing.helpers import CONFIGS, Worker, execute, groups_of, router_config, sync

PREFIX = list(range(100, 140))  # 40 tokens: aligned for every mix below


def two_workers(mix: str, host_blocks: int = 40) -> tuple[RoutingPolicy, dict[str, Worker]]:
    specs = CONFIGS[mix]
    policy = RoutingPolicy(groups_of(specs), router_config())
    workers = {f"w{i}": Worker(f"w{i}", specs, 48, host_blocks=host_blocks) for i in range(2)}
    for name in workers:
        policy.add_worker(name, num_blocks=48)
    return policy, workers


def the_pin(policy: RoutingPolicy) -> PinInfo:
    [info] = policy.pin_info()
    return info


def pinned_on_device(worker: Worker) -> int:
    return sum(1 for pool in worker.coord.pools for b in pool.blocks if b.tier == TIER_EXPLICIT)


def pinned_in_host(worker: Worker) -> int:
    host = worker.coord.host
    assert host is not None
    return sum(1 for pool in host.pools for b in pool.blocks if b.tier == TIER_EXPLICIT)


def pin_moves(actions: list[Action]) -> list[Action]:
    return [a for a in actions if isinstance(a, (PinOn, Unpin))]


def flood_until_host(policy: RoutingPolicy, workers: dict[str, Worker], holder: str) -> None:
    """Unrelated requests held on ``holder`` until its device gives some pinned block up (the
    router's view; every step checked to move nothing), then freed."""
    worker = workers[holder]
    for serial in range(30):
        if the_pin(policy).holder_tiers[holder] == "host":
            break
        assert worker.run([7000 + 50 * serial + k for k in range(17)]) is not None
        assert pin_moves(execute(policy, workers, sync(policy, workers))) == []
    else:
        pytest.fail("the flood never made the holder give its pinned blocks up")
    worker.finish_all()
    assert pin_moves(execute(policy, workers, sync(policy, workers))) == []


@pytest.mark.parametrize("mix", ["full+2swa", "full+swa8+mamba8", "full+mamba"])
def test_a_device_pin_offloaded_by_its_holder_stays_there_in_the_host_tier_and_comes_back(mix: str) -> None:
    policy, workers = two_workers(mix)
    pin_id, actions = policy.pin(PREFIX, replicas=1)
    execute(policy, workers, actions)
    info = the_pin(policy)
    [holder] = [str(w) for w in info.active]
    worker = workers[holder]
    assert info.holder_tiers == {holder: "device"}
    per_replica = info.blocks_per_replica
    assert pinned_on_device(worker) == per_replica

    flood_until_host(policy, workers, holder)
    info = the_pin(policy)
    assert [str(w) for w in info.active] == [holder] and info.pending == []  # kept, not re-placed
    assert info.tier == "device" and info.holder_tiers == {holder: "host"}
    # the coordinator agrees: fewer of the pin's blocks pinned on the device, the rest pinned in its host tier
    assert pinned_on_device(worker) < per_replica
    assert pinned_in_host(worker) >= per_replica - pinned_on_device(worker)
    assert worker.coord.host is not None and worker.coord.host.counters.pins_dropped == 0

    # a request with the prefix: routed to the holder, predicted per tier as its coordinator serves it
    prompt = [*PREFIX, 3, 1, 4, 1, 5]
    expected = worker.actual_tiers(prompt)
    assert expected[0] >= 40 and expected[1] > 0
    decision = policy.route(RouteRequest("q", block_hashes(prompt, policy.rules.hash_block_size), len(prompt)))
    assert decision.prefill_worker == holder and decision.reason == "pin" and decision.pin_id == pin_id
    assert (decision.predicted_hit, decision.predicted_host_hit) == expected
    assert worker.run(prompt) == expected[0]
    assert worker.last_hit == expected
    # promoted: pinned on the device again, and the router says so without moving the pin
    assert pin_moves(execute(policy, workers, sync(policy, workers))) == []
    assert pinned_on_device(worker) == per_replica
    assert the_pin(policy).holder_tiers == {holder: "device"}
    worker.finish_all()
    assert pin_moves(execute(policy, workers, sync(policy, workers))) == []
    worker.coord.check_invariants()

    # unpin releases both tiers
    execute(policy, workers, policy.unpin(pin_id))
    assert pinned_on_device(worker) == 0 and pinned_in_host(worker) == 0


def test_a_pin_gone_from_both_tiers_loses_its_holder() -> None:
    """A host tier too small for the pin: what the device gives up is dropped (the host tier is
    full of the pin's own blocks), so the holder holds it nowhere and the pin moves."""
    policy, workers = two_workers("full+2swa", host_blocks=4)
    _, actions = policy.pin(PREFIX, replicas=1)
    execute(policy, workers, actions)
    [holder] = [str(w) for w in the_pin(policy).active]
    worker = workers[holder]
    moved: list[Action] = []
    for serial in range(30):
        assert worker.run([7000 + 50 * serial + k for k in range(17)]) is not None
        moved = pin_moves(execute(policy, workers, sync(policy, workers)))
        if moved:
            break
    assert worker.coord.host is not None and worker.coord.host.counters.pins_dropped > 0
    assert (type(moved[0]), str(moved[0].worker)) == (Unpin, holder)
    [new] = [str(a.worker) for a in moved if isinstance(a, PinOn)]
    assert new != holder and the_pin(policy).holder_tiers == {new: "device"}
    assert pinned_in_host(worker) == 0  # the Unpin released what the old holder's host tier kept


def test_a_host_tier_pin_is_verified_from_host_events() -> None:
    policy, workers = two_workers("full+2swa")
    pin_id, actions = policy.pin(PREFIX, replicas=1, tier="host")
    [first] = actions
    assert isinstance(first, PinOn)
    # A holder that claims the pin while its host tier holds none of it: caught once the
    # router has its events up to the result's seq, and the pin moves.
    liar = workers[str(first.worker)]
    follow = policy.pin_result(first.worker, pin_id, 40, 1.0, liar.coord.event_seq)
    assert (type(follow[0]), follow[0].worker) == (Unpin, first.worker)
    [retry] = [a for a in follow if isinstance(a, PinOn)]
    assert retry.worker != first.worker and retry.tier == "host"
    execute(policy, workers, follow[1:], now=1.0)
    info = the_pin(policy)
    [holder] = [str(w) for w in info.active]
    assert holder == str(retry.worker) and info.holder_tiers == {holder: "host"}
    # The router watches the pin's keys in the holder's host tier: one leaving it loses the holder.
    hashes = block_hashes(PREFIX, policy.rules.hash_block_size)
    seq = policy.index.last_seq(holder) + 1
    lost = policy.apply_events(holder, [BlockDropped(seq, 0, (hashes[3],))], now=2.0)
    assert (type(lost[0]), str(lost[0].worker)) == (Unpin, holder)
