"""Automatic pins on decode workers' caches in P/D mode (``auto_pin.on_decode_workers``): the
hot prefix is pinned on a decode worker too (from its own budget), never on a prefill worker
twice, and not at all without the option or without dedicated decode workers."""

from __future__ import annotations

from engine.kv_cache.hashing import block_hashes
from engine.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from engine.routing import PinOn, RouteRequest, RoutingPolicy
from tests.routing.helpers import Worker, execute, groups_of, router_config, sync

SPECS = [FullAttentionSpec(4), SlidingWindowSpec(4, window=9)]
HOT = list(range(2000, 2040))


def pd_cluster(on_decode: bool, num_prefill: int = 1, num_decode: int = 2) -> tuple[RoutingPolicy, dict[str, Worker]]:
    config = router_config(
        auto_pin=True, auto_pin_min_requests=3, auto_pin_on_decode_workers=on_decode, decode_only_threshold_tokens=0
    )
    policy = RoutingPolicy(groups_of(SPECS), config)
    workers = {}
    for role, n in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(n):
            name = f"{role}-{i}"
            workers[name] = Worker(name, SPECS, 96)
            policy.add_worker(name, role, num_blocks=96)  # type: ignore[arg-type]
    return policy, workers


def send_hot(policy: RoutingPolicy, workers: dict[str, Worker], n: int) -> None:
    """Route requests for the hot prefix; the prefill and decode workers both end up holding it."""
    for i in range(n):
        prompt = [*HOT, 100 + i, 1, 2, 3]
        decision = policy.route(RouteRequest(f"r{i}", block_hashes(prompt, 4), len(prompt)), 1.0)
        for worker in {str(decision.prefill_worker), str(decision.decode_worker)}:
            workers[worker].run(prompt)
            workers[worker].finish(workers[worker].last_id)
        execute(policy, workers, sync(policy, workers, 1.0), 1.0)


def test_hot_prefix_is_pinned_on_a_decode_worker_too() -> None:
    policy, workers = pd_cluster(on_decode=True)
    send_hot(policy, workers, 6)
    actions = policy.tick(2.0)
    pins = [a for a in actions if isinstance(a, PinOn)]
    roles = sorted(policy.roles[a.worker] for a in pins)
    assert roles == ["decode", "prefill"], pins
    assert all(a.num_tokens == 40 for a in pins)
    execute(policy, workers, actions, 2.0)
    infos = policy.pin_info()
    assert len(infos) == 2 and all(info.auto and len(info.active) == 1 for info in infos)
    decode_holder = next(str(info.active[0]) for info in infos if policy.roles[info.active[0]] == "decode")
    assert workers[decode_holder].actual_hit([*HOT, 9]) == 40
    # a request for the prefix is not steered by either automatic pin
    prompt = [*HOT, 7, 7, 7, 7]
    decision = policy.route(RouteRequest("x", block_hashes(prompt, 4), len(prompt)), 3.0)
    assert decision.pin_id is None


def test_no_decode_pins_without_the_option_or_without_decode_workers() -> None:
    policy, workers = pd_cluster(on_decode=False)
    send_hot(policy, workers, 6)
    pins = [a for a in policy.tick(2.0) if isinstance(a, PinOn)]
    assert [policy.roles[a.worker] for a in pins] == ["prefill"]

    aggregated = RoutingPolicy(
        groups_of(SPECS), router_config(auto_pin=True, auto_pin_min_requests=3, auto_pin_on_decode_workers=True)
    )
    both = {f"w{i}": Worker(f"w{i}", SPECS, 96) for i in range(2)}
    for name in both:
        aggregated.add_worker(name, num_blocks=96)
    send_hot(aggregated, both, 6)
    pins = [a for a in aggregated.tick(2.0) if isinstance(a, PinOn)]
    assert len(pins) == 1 and len(aggregated.pin_info()) == 1
