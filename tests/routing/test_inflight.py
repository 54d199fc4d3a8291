"""In-flight prefixes: a prefix routed to a worker counts as held there until the worker reports
its blocks (or the entry expires). Property test of both trackers (``PyInFlightPrefixes`` and the
compiled ``engine/routing/_inflight.c``) against a brute-force model, the two against each other
call by call, then the policy."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache.events import AllBlocksCleared, BlockStored
from engine.kv_cache.hashing import block_hashes
from engine.routing import RouteRequest, RoutingPolicy, WorkerLoad
from engine.routing.holder_maps import CORE_ENV
from engine.routing.inflight import InFlightPrefixes, PyInFlightPrefixes, make_inflight
from tests.routing.helpers import CONFIGS, groups_of, router_config

WORKERS = ["a", "b", "c"]
TTL = 5.0


def chain(tokens: list[int]) -> list[bytes]:
    """Chained "hashes": block i's hash is the whole prefix up to it (as the real ones commit to)."""
    return [bytes(tokens[: i + 1]) for i in range(len(tokens))]


prompt = st.lists(st.integers(0, 2), min_size=1, max_size=8)  # few token values: prompts share prefixes
operation = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(WORKERS), prompt, st.integers(0, 8), st.floats(0, 3)),
    st.tuples(st.just("discard"), st.sampled_from(WORKERS), prompt, st.integers(0, 8), st.just(0.0)),
    st.tuples(st.just("forget"), st.sampled_from(WORKERS), prompt, st.just(0), st.just(0.0)),
    st.tuples(st.just("query"), st.just(""), prompt, st.just(0), st.floats(0, 3)),
)
known_blocks = st.dictionaries(st.sampled_from(WORKERS), st.integers(0, 8), max_size=3)


CORES = ("python", "compiled")


def test_the_compiled_tracker_is_built() -> None:
    tracker = make_inflight(TTL, core="auto")
    assert type(tracker).__module__ == "engine.routing._inflight", (
        "engine.routing._inflight is not built: run `python setup.py build_ext --inplace`"
    )
    with pytest.raises(ValueError, match="core: must be"):
        make_inflight(TTL, core="fast")


def test_the_policy_takes_the_tracker_the_core_variable_names(monkeypatch: pytest.MonkeyPatch) -> None:
    for core, module in (("python", "engine.routing.inflight"), ("compiled", "engine.routing._inflight")):
        monkeypatch.setenv(CORE_ENV, core)
        policy = RoutingPolicy(groups_of(SPECS), router_config(seed=0))
        assert type(policy.routed.store).__module__ == module


@pytest.mark.parametrize("core", CORES)
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(operation, known_blocks), max_size=40))
def test_depths_match_a_brute_force_model(
    core: str, ops: list[tuple[tuple[str, str, list[int], int, float], dict[str, int]]]
) -> None:
    tracker = make_inflight(TTL, core=core)
    model: list[tuple[str, list[bytes], int, float]] = []  # (worker, hashes, start, expiry), end = len
    now = 0.0
    for (kind, worker, tokens, start, step), known in ops:
        now += step
        hashes = chain(tokens)
        if kind == "add":
            tracker.add(worker, hashes, start, len(hashes), now)
            if start < len(hashes):
                model.append((worker, hashes, start, now + TTL))
        elif kind == "discard":
            tracker.discard(worker, hashes[start:])
            gone = set(hashes[start:])
            model = [m for m in model if not (m[0] == worker and m[1][m[2]] in gone)]
        elif kind == "forget":
            tracker.forget_worker(worker)
            model = [m for m in model if m[0] != worker]
        else:
            expected: dict[str, int] = {}
            for w, sent, begin, expiry in model:
                if expiry <= now or begin != known.get(w, 0) or begin >= len(hashes):
                    continue  # expired, or not continuing what the worker holds
                depth = begin
                while depth < min(len(sent), len(hashes)) and sent[depth] == hashes[depth]:
                    depth += 1
                if depth > begin:
                    expected[w] = max(expected.get(w, 0), depth)
            assert tracker.depths(hashes, now, known) == expected
            for w in WORKERS:  # the per-worker keys discard reads, after depths expired the old ones
                assert tracker.announced(w) == any(m[0] == w and m[3] > now for m in model)
    tracker.expire(now + TTL + 1)
    assert len(tracker) == 0 and not tracker  # nothing outlives its expiry
    assert not any(tracker.announced(w) for w in WORKERS)


TRACKED = [*WORKERS, "d"]  # one more worker than the model test's
fresh = st.booleans()  # hand the tracker new hash objects (equal bytes, not the same objects)
call = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(TRACKED), prompt, st.integers(0, 9), st.floats(0, 3), fresh),
    st.tuples(st.just("discard"), st.sampled_from(TRACKED), prompt, st.integers(0, 8), st.just(0.0), fresh),
    st.tuples(st.just("forget"), st.sampled_from(TRACKED), prompt, st.just(0), st.just(0.0), fresh),
    st.tuples(st.just("expire"), st.just(""), prompt, st.just(0), st.floats(0, 6), fresh),
    st.tuples(st.just("query"), st.just(""), prompt, st.just(0), st.floats(0, 2), fresh),
)


def renewed(hashes: list[bytes]) -> list[bytes]:
    return [bytes(bytearray(h)) for h in hashes]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(call, known_blocks), max_size=50), st.floats(0, 4))
def test_compiled_and_python_trackers_agree_call_by_call(
    ops: list[tuple[tuple[str, str, list[int], int, float, bool], dict[str, int]]], ttl: float
) -> None:
    """Every answer alike, the order of a ``depths`` result's workers included (the pick's ties
    read it), over adds with an ``end`` short of the prompt, expiries and a TTL of 0."""
    ttl = 0.0 if ttl < 0.5 else ttl
    ref, fast = PyInFlightPrefixes(ttl), make_inflight(ttl, core="compiled")
    assert fast.ttl_s == ref.ttl_s == ttl
    now = 0.0
    for (kind, worker, tokens, start, step, new), known in ops:
        now += step
        hashes = chain(tokens)
        other = renewed(hashes) if new else hashes
        if kind == "add":
            end = len(hashes) - start % 3
            ref.add(worker, hashes, start, end, now)
            fast.add(worker, other, start, end, now)
        elif kind == "discard":
            ref.discard(worker, hashes[start:])
            fast.discard(worker, tuple(other[start:]))
        elif kind == "forget":
            ref.forget_worker(worker)
            fast.forget_worker(worker)
        elif kind == "expire":
            ref.expire(now)
            fast.expire(now)
        else:
            assert list(fast.depths(other, now, known).items()) == list(ref.depths(hashes, now, known).items())
            assert fast.depths(other, now) == ref.depths(hashes, now)
        assert len(fast) == len(ref) and bool(fast) == bool(ref)
        for w in TRACKED:
            assert fast.announced(w) == ref.announced(w)


def test_many_announcements_grow_the_compiled_tables_and_all_expire() -> None:
    """Thousands of announcements over a hundred workers (the key table and the FIFO grow many
    times), queried against the reference, then reported, forgotten or expired to nothing."""
    rng = random.Random(7)
    ref, fast = PyInFlightPrefixes(10.0), make_inflight(10.0, core="compiled")
    workers = [f"w{k}" for k in range(100)]
    prompts = [chain([rng.randrange(4) for _ in range(rng.randrange(1, 12))]) for _ in range(3000)]
    for i, hashes in enumerate(prompts):
        worker, start, now = rng.choice(workers), rng.randrange(3), i * 0.001
        ref.add(worker, hashes, start, len(hashes), now)
        fast.add(worker, renewed(hashes), start, len(hashes), now)
    assert len(fast) == len(ref) > 2000
    for hashes in prompts[:300]:
        known = {w: rng.randrange(3) for w in rng.sample(workers, 5)}
        assert list(fast.depths(hashes, 3.0, known).items()) == list(ref.depths(hashes, 3.0, known).items())
    for worker in workers[:30]:
        ref.forget_worker(worker)
        fast.forget_worker(worker)
    for worker, hashes in zip(workers[30:60], prompts, strict=False):
        ref.discard(worker, hashes)
        fast.discard(worker, renewed(hashes))
    assert len(fast) == len(ref) and [fast.announced(w) for w in workers] == [ref.announced(w) for w in workers]
    ref.expire(12.0)
    fast.expire(12.0)  # those added in the last second stay
    assert len(fast) == len(ref) > 0 and [fast.announced(w) for w in workers] == [ref.announced(w) for w in workers]
    ref.expire(20.0)
    fast.expire(20.0)
    assert len(fast) == len(ref) == 0 and not fast and not any(fast.announced(w) for w in workers)


@pytest.mark.parametrize("core", CORES)
def test_a_negative_ttl_or_start_is_refused(core: str) -> None:
    with pytest.raises(ValueError, match="inflight_ttl_s"):
        make_inflight(-1.0, core=core)
    tracker: InFlightPrefixes = make_inflight(TTL, core=core)
    with pytest.raises(ValueError, match="start: must be >= 0"):
        tracker.add("a", chain([1, 2, 3]), -1, 3, 0.0)
    assert len(tracker) == 0


SPECS = CONFIGS["full+2swa"]


def two_requests(policy: RoutingPolicy, prompt_a: list[int], prompt_b: list[int]) -> tuple[str, str, str, int]:
    first = policy.route(RouteRequest("a", block_hashes(prompt_a, 4), len(prompt_a)), now=0.0)
    second = policy.route(RouteRequest("b", block_hashes(prompt_b, 4), len(prompt_b)), now=0.1)
    return str(first.prefill_worker), str(second.prefill_worker), second.reason, second.predicted_hit


@pytest.mark.parametrize("seed", range(8))
def test_a_second_request_follows_the_first_before_its_blocks_are_reported(seed: int) -> None:
    prefix = list(range(100, 300))
    policy = RoutingPolicy(groups_of(SPECS), router_config(seed=seed))
    for i in range(4):
        policy.add_worker(f"w{i}")
    first, second, reason, predicted = two_requests(policy, [*prefix, 1, 2, 3], [*prefix, 4, 5, 6])
    assert second == first and reason == "inflight"
    assert predicted == 0  # the prediction stays what the worker's cache holds now: nothing yet


def test_without_the_credit_the_second_request_goes_to_the_least_loaded() -> None:
    prefix = list(range(100, 300))
    seen = set()
    for seed in range(8):
        policy = RoutingPolicy(groups_of(SPECS), router_config(seed=seed, inflight_ttl_s=0.0))
        for i in range(4):
            policy.add_worker(f"w{i}")
        first, second, reason, _ = two_requests(policy, [*prefix, 1, 2, 3], [*prefix, 4, 5, 6])
        assert second != first and reason == "cost"
        seen.add(second)
    assert len(seen) > 1  # random among the idle ones


def test_reported_blocks_end_the_credit_and_a_cleared_cache_drops_it() -> None:
    prefix = list(range(100, 300))
    policy = RoutingPolicy(groups_of(SPECS), router_config(seed=0))
    for i in range(2):
        policy.add_worker(f"w{i}")
    decision = policy.route(RouteRequest("a", block_hashes([*prefix, 1], 4), 201), now=0.0)
    worker = str(decision.prefill_worker)
    assert len(policy.routed.store) == 1
    hashes = tuple(block_hashes(prefix, 4))
    policy.apply_events(worker, [BlockStored(1 + g, g, hashes) for g in range(3)], now=0.5)
    assert len(policy.routed.store) == 0
    decision = policy.route(RouteRequest("b", block_hashes([*list(range(500, 700)), 1], 4), 201), now=1.0)
    other = str(decision.prefill_worker)
    assert len(policy.routed.store) == 1
    policy.apply_events(other, [AllBlocksCleared(policy.index.last_seq(other) + 1)], now=1.5)
    assert len(policy.routed.store) == 0


def test_the_credit_expires() -> None:
    prefix = list(range(100, 300))
    policy = RoutingPolicy(groups_of(SPECS), router_config(seed=0, inflight_ttl_s=2.0))
    for i in range(2):
        policy.add_worker(f"w{i}")
    first = policy.route(RouteRequest("a", block_hashes([*prefix, 1], 4), 201), now=0.0)
    # the first worker is now busier; after the TTL the credit is gone and load decides
    policy.update_load(str(first.prefill_worker), WorkerLoad(queued_tokens=500, running_requests=1))
    later = policy.route(RouteRequest("b", block_hashes([*prefix, 2], 4), 201), now=2.5)
    assert later.prefill_worker != first.prefill_worker and later.reason == "cost"


def test_the_credit_is_held_to_the_imbalance_guard() -> None:
    """A hot new prefix does not pile onto the worker computing it once that worker is overloaded."""
    prefix = list(range(100, 300))
    policy = RoutingPolicy(
        groups_of(SPECS), router_config(seed=0, imbalance_slack_tokens=0.0, work_imbalance_ratio=0.0)
    )
    for i in range(2):
        policy.add_worker(f"w{i}")
    first = str(policy.route(RouteRequest("a", block_hashes([*prefix, 1], 4), 201), now=0.0).prefill_worker)
    other = "w1" if first == "w0" else "w0"
    policy.update_load(first, WorkerLoad(queued_tokens=5000, running_requests=4))
    policy.update_load(other, WorkerLoad(queued_tokens=0, running_requests=0))
    decision = policy.route(RouteRequest("b", block_hashes([*prefix, 2], 4), 201), now=0.1)
    assert decision.prefill_worker == other
