"""Placement: prefix vs load cost, random tie-break, imbalance guard, P/D choice, config, baselines."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from pydantic import ValidationError

from configs.schema import PinConfig, RouterConfig, RouterWeights
from engine.kv_cache.events import BlockStored
from engine.kv_cache.hashing import block_hashes
from engine.routing import (
    LeastLoadedPolicy,
    NoWorkerError,
    PrefixTreePolicy,
    RoundRobinPolicy,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
    build_router,
)
from engine.routing.load import DecayedWork, PyLoadBook, SmoothedQueues, knobs_of
from tests.routing.helpers import CONFIGS, groups_of, router_config

SPECS = CONFIGS["full+2swa"]
GROUPS = groups_of(SPECS)
PREFIX = list(range(200))


def request(rid: str, prompt: list[int]) -> RouteRequest:
    return RouteRequest(rid, block_hashes(prompt, 4), len(prompt))


def cache(policy: RoutingPolicy, worker: str, prompt: list[int]) -> None:
    """Announce ``prompt``'s blocks as cached in every group of ``worker``."""
    hashes = tuple(block_hashes(prompt, 4))
    seq = policy.index.last_seq(worker)
    policy.apply_events(worker, [BlockStored(seq + 1 + g, g, hashes) for g in range(3)])


def policy_with(n: int, **kwargs: object) -> RoutingPolicy:
    policy = RoutingPolicy(GROUPS, router_config(**kwargs))  # type: ignore[arg-type]
    for i in range(n):
        policy.add_worker(f"w{i}")
    return policy


def test_prefers_the_worker_holding_the_prefix() -> None:
    policy = policy_with(4)
    cache(policy, "w2", PREFIX)
    decision = policy.route(request("r", [*PREFIX, 1, 2, 3]))
    assert decision.prefill_worker == decision.decode_worker == "w2"
    assert decision.predicted_hit == 200 and decision.reason == "prefix"


def test_load_outweighs_a_small_hit() -> None:
    policy = policy_with(2)
    cache(policy, "w0", PREFIX[:40])
    policy.update_load("w0", WorkerLoad(queued_tokens=2000, running_requests=8, used_block_fraction=0.5))
    decision = policy.route(request("r", [*PREFIX, 1]))
    assert decision.prefill_worker == "w1"


def test_ties_are_broken_at_random_and_seeded() -> None:
    def picks(seed: int) -> list[str]:
        policy = policy_with(4, seed=seed)
        out = []
        for i in range(200):
            d = policy.route(request(f"r{i}", [i, i + 1, i + 2, i + 3, i + 4]))
            policy.update_load(d.prefill_worker, WorkerLoad())  # the worker reports it is idle again
            out.append(str(d.prefill_worker))
        return out

    assert picks(1) == picks(1)
    counts = Counter(picks(1))
    assert set(counts) == {"w0", "w1", "w2", "w3"} and min(counts.values()) > 25


def test_imbalance_guard_spreads_a_hot_prefix_to_a_second_worker() -> None:
    def chosen(imbalance_ratio: float) -> list[str]:
        policy = policy_with(
            4,
            w_queued=0.01,
            w_running=0.0,
            w_used=0.0,
            imbalance_ratio=imbalance_ratio,
            imbalance_slack_tokens=0.0,
            work_imbalance_ratio=0.0,
        )
        cache(policy, "w0", PREFIX)
        queued: Counter[str] = Counter()
        out = []
        for i in range(12):
            worker = str(policy.route(request(f"r{i}", [*PREFIX, 1000 + i])).prefill_worker)
            queued[worker] += 600  # the worker reports its queue (prefill + decode work)
            policy.update_load(worker, WorkerLoad(queued_tokens=queued[worker], running_requests=1))
            out.append(worker)
        return out

    assert set(chosen(1e9)) == {"w0"}  # cost alone piles the hot prefix onto its holder
    guarded = chosen(2.0)
    assert guarded[0] == "w0" and len(set(guarded)) >= 2


@pytest.mark.parametrize("core", ["python", "compiled"])
def test_a_decision_is_a_guards_only_when_it_gave_up_a_longer_hit(core: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard that refused a worker holding nothing does not make the holder's pick a "guard"
    decision (it kept the best hit: "prefix"); a guard that moved the request off the holder does
    (the chosen worker's hit is below the best one), on both cores."""
    from engine.routing.holder_maps import CORE_ENV

    monkeypatch.setenv(CORE_ENV, core)
    # a popular prefix's rule (a family of its own is not guarded: test_prefix_reuse)
    knobs = {
        "imbalance_ratio": 1.0,
        "imbalance_slack_tokens": 0.0,
        "work_imbalance_ratio": 0.0,
        "family_min_reuse": 0.0,
    }
    policy = policy_with(3, **knobs)
    cache(policy, "w0", PREFIX)
    policy.update_load("w2", WorkerLoad(queued_tokens=50_000, running_requests=4))  # far over the mean
    kept = policy.route(request("a", [*PREFIX, 1]))
    assert (kept.prefill_worker, kept.reason, kept.predicted_hit, kept.best_hit) == ("w0", "prefix", 200, 200)
    policy = policy_with(3, **knobs)
    cache(policy, "w0", PREFIX)
    policy.update_load("w0", WorkerLoad(queued_tokens=50_000, running_requests=4))  # the holder is refused
    moved = policy.route(request("b", [*PREFIX, 2]))
    assert moved.prefill_worker != "w0" and moved.reason == "guard" and moved.predicted_hit < moved.best_hit == 200


def test_instantaneous_guard_ignores_a_queue_within_the_slack() -> None:
    """A burst on the holder below ``imbalance_slack_tokens`` does not move its prefix elsewhere."""

    def chosen(slack: float) -> str:
        policy = policy_with(
            4,
            w_queued=0.01,
            w_running=0.0,
            w_used=0.0,
            imbalance_ratio=2.0,
            load_halflife_s=0.0,
            work_imbalance_ratio=0.0,
            imbalance_slack_tokens=slack,
            family_min_reuse=0.0,  # a popular prefix's rule (a family of its own is not guarded)
        )
        cache(policy, "w0", PREFIX)
        policy.update_load("w0", WorkerLoad(queued_tokens=3000))  # limit 2 x 750 + 201 (+ slack)
        return str(policy.route(request("r", [*PREFIX, 1])).prefill_worker)

    assert chosen(0.0) != "w0"
    assert chosen(4096.0) == "w0"


def test_decayed_work_compares_workers_in_constant_time() -> None:
    work = DecayedWork(halflife_s=2.0)
    work.add_worker("a")
    work.add_worker("b")
    work.add("a", 100.0, now=0.0)
    work.add("b", 50.0, now=2.0)
    assert work.get("a", 2.0) == pytest.approx(50.0) and work.get("b", 2.0) == pytest.approx(50.0)
    assert work.mean(4.0) == pytest.approx(25.0)
    work.remove("a")
    assert work.mean(4.0) == pytest.approx(25.0)  # b alone: 25 / 1
    with pytest.raises(ValueError, match="work_halflife_s"):
        DecayedWork(0.0)


def test_smoothed_queues_average_over_time_in_constant_time() -> None:
    queues = SmoothedQueues(halflife_s=2.0)
    queues.add("a")
    queues.add("b")
    queues.set("a", 100.0, now=0.0)
    assert queues.get("a", 0.0) == 0.0 and queues.get("a", 2.0) == pytest.approx(50.0)
    assert queues.get("a", 4.0) == pytest.approx(75.0) and queues.mean(2.0) == pytest.approx(25.0)
    queues.set("a", 0.0, now=4.0)  # the average then decays from 75 towards 0
    assert queues.get("a", 6.0) == pytest.approx(37.5) and queues.mean(6.0) == pytest.approx(18.75)
    queues.remove("a")
    assert queues.mean(6.0) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="load_halflife_s"):
        SmoothedQueues(0.0)


def test_new_router_knobs_come_from_config_and_are_validated() -> None:
    cfg = RouterConfig(
        weights=RouterWeights(cache_churn=0.25), anchor_credit=0.75, load_halflife_s=2.0, sustained_imbalance_ratio=1.6
    )
    policy = build_router(cfg, GROUPS)
    assert isinstance(policy, RoutingPolicy)
    assert policy.config is cfg  # the policy reads its knobs from the config, no copies
    assert (policy.weights.cache_churn, policy.w_miss) == (0.25, 1.25)
    book = PyLoadBook(knobs_of(cfg), {}, random.Random(0).randrange)
    assert book.knobs.anchor_credit == 0.75 and book.knobs.sustained_imbalance_ratio == 1.6
    assert book.queues is not None and book.queues.halflife_s == 2.0 and book.assigned.halflife_s == 10.0
    defaults = build_router(RouterConfig(), GROUPS)
    assert isinstance(defaults, RoutingPolicy) and defaults.w_miss == 2.0
    assert (defaults.config.load_halflife_s, defaults.config.work_halflife_s) == (5.0, 10.0)
    assert PyLoadBook(knobs_of(RouterConfig(load_halflife_s=0.0)), {}, random.Random(0).randrange).queues is None
    for bad, field in (
        ({"sustained_imbalance_ratio": 0.9}, "sustained_imbalance_ratio"),
        ({"anchor_credit": 1.5}, "anchor_credit"),
        ({"load_halflife_s": -1.0}, "load_halflife_s"),
        ({"weights": {"cache_churn": -0.1}}, "cache_churn"),
        ({"work_imbalance_ratio": -1.0}, "work_imbalance_ratio"),
        ({"work_halflife_s": 0.0}, "work_halflife_s"),
        ({"request_work_tokens": -1.0}, "request_work_tokens"),
        ({"imbalance_slack_tokens": -1.0}, "imbalance_slack_tokens"),
        ({"work_imbalance_ratio": 0.5}, "work_imbalance_ratio"),
        ({"pin_worker_fraction": 0.0}, "pin_worker_fraction"),
        ({"auto_pin": {"interval_s": 0.0}}, "interval_s"),
    ):
        with pytest.raises(ValidationError, match=field):
            RouterConfig(**bad)  # type: ignore[arg-type]


def test_disaggregated_pair_and_prefill_on_decode_below_threshold() -> None:
    policy = RoutingPolicy(GROUPS, router_config(decode_only_threshold_tokens=64))
    policy.add_worker("p0", role="prefill")
    policy.add_worker("p1", role="prefill")
    policy.add_worker("d0", role="decode")
    cache(policy, "p1", PREFIX)
    cache(policy, "d0", PREFIX[:100])
    decision = policy.route(request("r", PREFIX + list(range(500, 520))))
    assert (decision.prefill_worker, decision.decode_worker) == ("p1", "d0")
    assert decision.predicted_hit == 200 and decision.predicted_decode_hit == 100
    cache(policy, "d0", PREFIX)
    short = policy.route(request("s", PREFIX + list(range(500, 520))))  # 20 uncached on d0 < 64
    assert (short.prefill_worker, short.decode_worker, short.reason) == ("d0", "d0", "decode_only")


def test_a_decode_worker_prefills_a_long_prompt_only_while_the_prefill_pool_is_congested() -> None:
    """``local_prefill_margin_tokens``: an idle prefill worker keeps every long prefill; once its
    queue costs more than the margin's uncached tokens, a less loaded decode worker prefills the
    request itself (``decode_local``); None turns the rule off."""
    fresh = list(range(1000, 1272))  # 272 tokens nobody holds

    def pool(margin: int | None) -> RoutingPolicy:
        policy = RoutingPolicy(GROUPS, router_config(local_prefill_margin_tokens=margin))
        policy.add_worker("p0", role="prefill")
        policy.add_worker("d0", role="decode")
        return policy

    assert RouterConfig().local_prefill_margin_tokens is None  # off unless configured
    idle = pool(64)
    assert idle.route(request("a", fresh)).reason != "decode_local"
    busy = pool(64)
    busy.update_load("p0", WorkerLoad(queued_tokens=272.0, running_requests=1))
    local = busy.route(request("b", fresh))
    assert (local.prefill_worker, local.decode_worker, local.reason) == ("d0", "d0", "decode_local")
    assert local.predicted_hit == 0
    slightly = pool(64)  # queue cost 0.5 * 200 + 16 = 116 <= 2.0 * 64: not congested
    slightly.update_load("p0", WorkerLoad(queued_tokens=200.0, running_requests=1))
    assert slightly.route(request("c", fresh)).prefill_worker == "p0"
    off = pool(None)
    off.update_load("p0", WorkerLoad(queued_tokens=272.0, running_requests=1))
    assert off.route(request("d", fresh)).prefill_worker == "p0"
    loaded_decode = pool(64)  # the decode worker costs more than the congested prefill worker
    loaded_decode.update_load("p0", WorkerLoad(queued_tokens=272.0, running_requests=1))
    loaded_decode.update_load("d0", WorkerLoad(queued_tokens=600.0, running_requests=8))
    assert loaded_decode.route(request("e", fresh)).prefill_worker == "p0"


def test_a_one_token_request_runs_whole_on_the_cheapest_worker_of_either_role() -> None:
    """``max_tokens`` 1 (``RouteRequest.max_tokens``): nothing to decode, so no split; it runs whole
    (``one_token``) where it costs least, an idle prefill worker included. Without ``max_tokens``
    or with more than one, the P/D rules stand."""
    policy = RoutingPolicy(GROUPS, router_config(decode_only_threshold_tokens=64))
    policy.add_worker("p0", role="prefill")
    policy.add_worker("d0", role="decode")
    cache(policy, "p0", PREFIX)
    cache(policy, "d0", PREFIX)
    prompt = PREFIX + list(range(500, 520))
    hashes = block_hashes(prompt, 4)
    idle_prefill = policy.route(RouteRequest("a", hashes, len(prompt)))
    assert (idle_prefill.prefill_worker, idle_prefill.decode_worker, idle_prefill.reason) == ("d0", "d0", "decode_only")
    policy.update_load("d0", WorkerLoad(queued_tokens=300.0, running_requests=8))  # d0 busy, p0 idle
    one = policy.route(RouteRequest("b", hashes, len(prompt), 1))
    assert (one.prefill_worker, one.decode_worker, one.reason) == ("p0", "p0", "one_token")
    assert one.predicted_hit == one.predicted_decode_hit == 200
    assert policy.route(RouteRequest("c", hashes, len(prompt), 2)).decode_worker == "d0"
    fresh = list(range(1000, 1272))  # 272 tokens nobody holds: a split without max_tokens 1
    assert policy.route(RouteRequest("d", block_hashes(fresh, 4), len(fresh))).prefill_worker == "p0"
    whole = policy.route(RouteRequest("e", block_hashes(fresh, 4), len(fresh), 1))
    assert whole.prefill_worker == whole.decode_worker and whole.reason == "one_token"
    policy.update_load("d0", WorkerLoad())
    policy.update_load("p0", WorkerLoad(queued_tokens=600.0, running_requests=8))  # now p0 is the busy one
    assert policy.route(RouteRequest("f", hashes, len(prompt), 1)).decode_worker == "d0"
    split = RoutingPolicy(GROUPS, router_config(decode_only_threshold_tokens=0))  # every request split
    split.add_worker("p0", role="prefill")
    split.add_worker("d0", role="decode")
    always = split.route(RouteRequest("g", block_hashes(fresh, 4), len(fresh), 1))
    assert (always.prefill_worker, always.decode_worker) == ("p0", "d0")


def test_a_decode_worker_holding_the_prompt_runs_it_whole_though_another_was_chosen_to_decode() -> None:
    """The decode worker is chosen for its load; when another decode worker holds all but
    ``decode_only_threshold_tokens`` of the prompt and running it whole there costs less than
    recomputing it on a prefill worker, it runs there (``decode_only``), not as a miss."""
    policy = RoutingPolicy(GROUPS, router_config(decode_only_threshold_tokens=64))
    policy.add_worker("p0", role="prefill")
    policy.add_worker("d0", role="decode")
    policy.add_worker("d1", role="decode")
    cache(policy, "d0", PREFIX)
    policy.update_load("d0", WorkerLoad(queued_tokens=0.0, running_requests=4))  # d1 idle: D = d1
    decision = policy.route(request("r", PREFIX + list(range(500, 520))))
    assert (decision.prefill_worker, decision.decode_worker, decision.reason) == ("d0", "d0", "decode_only")
    assert decision.predicted_hit == 200  # the 200 tokens d0 holds
    policy.update_load("d0", WorkerLoad(queued_tokens=2000.0, running_requests=4))  # now a miss is cheaper
    remote = policy.route(request("s", PREFIX + list(range(600, 620))))
    assert (remote.prefill_worker, remote.decode_worker) == ("p0", "d1")


def test_no_worker_for_a_role_is_a_clear_error() -> None:
    policy = RoutingPolicy(GROUPS)
    policy.add_worker("p0", role="prefill")
    with pytest.raises(NoWorkerError, match="decode"):
        policy.route(request("r", PREFIX))
    with pytest.raises(ValueError, match="role"):
        policy.add_worker("x", role="both?")  # type: ignore[arg-type]


def test_from_config_carries_weights_thresholds_seed_and_pins() -> None:
    cfg = RouterConfig(
        weights=RouterWeights(uncached_tokens=2.0, queued_tokens=0.25, running_requests=4.0, used_block_fraction=8.0),
        decode_only_threshold_tokens=32,
        imbalance_ratio=1.5,
        pin_capacity_blocks=1000,
        pins=[PinConfig(token_ids=PREFIX[:64], replicas=1, ttl_s=30.0)],
        seed=5,
    )
    policy = build_router(cfg, GROUPS)
    assert isinstance(policy, RoutingPolicy) and policy.rng.random() == random.Random(5).random()
    assert policy.pins.capacity_blocks == 1000
    [pin] = policy.pin_info()
    assert pin.num_tokens == 64 and pin.expires_at == 30.0 and pin.pending == []  # placed once workers join
    actions = policy.add_worker("w0")
    assert [type(a).__name__ for a in actions] == ["PinOn"]
    with pytest.raises(ValueError, match="tokenizer"):
        build_router(RouterConfig(pins=[PinConfig(text="system prompt")]), GROUPS)
    text_cfg = RouterConfig(pins=[PinConfig(text="abc")])
    tokenized = build_router(text_cfg, GROUPS, tokenize=lambda s: [ord(c) for c in s * 8])
    assert tokenized.pin_info()[0].num_tokens == 24  # type: ignore[attr-defined]
    baselines = {"round_robin": RoundRobinPolicy, "least_loaded": LeastLoadedPolicy, "prefix_tree": PrefixTreePolicy}
    for name, cls in baselines.items():
        assert isinstance(build_router(RouterConfig(policy=name), GROUPS), cls)  # type: ignore[arg-type]


def test_baselines() -> None:
    rr = RoundRobinPolicy()
    ll = LeastLoadedPolicy(seed=0)
    tree = PrefixTreePolicy(GROUPS, imbalance_threshold=3)
    for router in (rr, ll, tree):
        for i in range(3):
            router.add_worker(f"w{i}")
    assert [rr.route(request(f"r{i}", PREFIX)).prefill_worker for i in range(4)] == ["w0", "w1", "w2", "w0"]
    ll.update_load("w0", WorkerLoad(queued_tokens=10))
    ll.update_load("w1", WorkerLoad(queued_tokens=5))
    ll.update_load("w2", WorkerLoad(queued_tokens=7))
    assert ll.route(request("r", PREFIX)).prefill_worker == "w1"
    first = tree.route(request("a", [*PREFIX, 1])).prefill_worker
    second = tree.route(request("b", [*PREFIX, 2]))
    assert second.prefill_worker == first and second.reason == "prefix" and second.predicted_hit == 200
    reasons = [tree.route(request(f"c{i}", [*PREFIX, 3 + i])).reason for i in range(6)]
    assert "imbalanced" in reasons  # the router's own count of running requests


def test_routing_with_lazy_resolution_picks_a_minimum_cost_worker() -> None:
    """route() resolves workers below their full-attention depth only when they could win; its
    choice must still be a minimum of the fully resolved cost, and its predicted hit exact."""
    import random

    from tests.routing.helpers import Worker, sync, tokens

    rng = random.Random(4)
    specs = CONFIGS["full+2swa"]
    workers = {f"w{i}": Worker(f"w{i}", specs, rng.choice([24, 40])) for i in range(6)}
    # the guards and the in-flight credit have their own tests: here only the instantaneous guard,
    # which the costs below mirror (requests routed here never run, so nothing is in flight)
    policy = RoutingPolicy(
        groups_of(specs),
        router_config(
            seed=1, work_imbalance_ratio=0.0, imbalance_slack_tokens=0.0, inflight_ttl_s=0.0, family_min_reuse=0.0
        ),
    )
    for name in workers:
        policy.add_worker(name)
    prefixes = [tokens(rng, rng.randrange(8, 48), vocab=6) for _ in range(5)]
    for step in range(300):
        worker = workers[rng.choice(sorted(workers))]
        if rng.random() < 0.6:
            worker.run(rng.choice(prefixes) + tokens(rng, rng.randrange(1, 9), vocab=6))
        else:
            worker.finish(rng=rng)
        sync(policy, workers)
        for name in workers:
            policy.update_load(name, WorkerLoad(queued_tokens=rng.randrange(0, 60), running_requests=rng.randrange(3)))
        prompt = rng.choice(prefixes) + tokens(rng, 3, vocab=6)
        hashes = block_hashes(prompt, 4)
        shared: dict[str, int] = {}
        full = policy.index.predict(hashes, len(prompt) - 1, shared=shared)  # type: ignore[arg-type]
        limit = policy.config.imbalance_ratio * policy.book.queued_sum / len(workers) + len(prompt)
        costs = {}
        for name in workers:
            if policy.book.queued[name] > limit:
                continue
            hit = full.get(name, 0)
            credit = hit + policy.config.anchor_credit * (shared.get(name, hit) - hit)
            costs[name] = policy.book.load_cost[name] + policy.w_miss * (len(prompt) - credit)
        decision = policy.route(RouteRequest(f"r{step}", hashes, len(prompt)))
        assert costs[str(decision.prefill_worker)] <= min(costs.values()) + 1e-6
        assert decision.predicted_hit == workers[str(decision.prefill_worker)].actual_hit(prompt)


@pytest.mark.parametrize("core", ["python", "compiled"])
def test_the_books_whole_pool_pick_is_the_policys_rule(core: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LoadBook.choose`` (what ``route`` asks first, for a request without a pin on the whole
    pool) against ``RoutingPolicy._pick``, the general rule, on the same state and the same random
    state, with host tiers (hits partly served there, priced by the workers' promote costs): where
    the book chooses, ``_pick`` chooses the same worker for the same reason; and where the book
    declines, it has drawn nothing."""
    from engine.routing.holder_maps import CORE_ENV
    from tests.routing.helpers import Worker, sync, tokens

    monkeypatch.setenv(CORE_ENV, core)
    rng = random.Random(9)
    specs = CONFIGS["full+2swa"]
    hosts = {"w1": 48, "w3": 32, "w4": 64}  # host tiers' blocks (the others have none)
    workers = {
        f"w{i}": Worker(f"w{i}", specs, rng.choice([16, 24, 40]), host_blocks=hosts.get(f"w{i}")) for i in range(6)
    }
    policy = RoutingPolicy(groups_of(specs), router_config(seed=3, load_halflife_s=2.0, work_imbalance_ratio=1.3))
    for name in workers:
        policy.add_worker(name)
    prefixes = [tokens(rng, rng.randrange(8, 48), vocab=6) for _ in range(5)]
    chosen = declined = hosted = 0
    for step in range(300):
        worker = workers[rng.choice(sorted(workers))]
        if rng.random() < 0.6:
            worker.run(rng.choice(prefixes) + tokens(rng, rng.randrange(1, 9), vocab=6))
        else:
            worker.finish(rng=rng)
        sync(policy, workers, now=step * 0.1)
        for name in workers:
            promote = rng.choice([0.0, 1e-6, 2e-5, 1e-3]) if name in hosts else 0.0
            load = WorkerLoad(rng.randrange(0, 60), rng.randrange(3), promote_s_per_token=promote)
            policy.update_load(name, load)
        prompt = rng.choice(prefixes) + tokens(rng, 3, vocab=6)
        hashes = block_hashes(prompt, 4)
        now = step * 0.1
        policy._now = now
        shared: dict[str, int] = {}
        host: dict[str, int] = {}
        hits, pending, _ = policy.index.predict_partial(hashes, len(prompt) - 1, shared=shared, host=host)  # type: ignore[arg-type]
        pending_workers = pending.workers if pending is not None else ()
        w_miss, w_spread = policy.w_miss, min(policy.w_miss, policy.weights.uncached_tokens)
        state = policy.rng.getstate()
        request = (hits, shared, host, None, pending_workers, len(prompt), now, w_miss, w_spread)
        shortcut = policy.book.choose(*request)  # type: ignore[arg-type]
        if shortcut is None:
            assert policy.rng.getstate() == state
            declined += 1
        else:
            policy.rng.setstate(state)
            pick = policy._pick(list(workers), hits, len(prompt), None, w_miss, shared, pending, host=host)
            assert pick == shortcut, step
            chosen += 1
            hosted += any(host.values())
        policy.route(RouteRequest(f"r{step}", hashes, len(prompt)), now)
    assert chosen > 100 and hosted > 10, (chosen, hosted)
