"""Prefix reuse counts (``engine.routing.prefix_reuse``) and the rule the policy reads from them:
a request whose cached prefix few requests reused lately is a family of its own and keeps its
holder, where a popular prefix's holder over its queue limit is left out."""

from __future__ import annotations

import random

import pytest

from engine.routing import WorkerLoad
from engine.routing.holder_maps import compiled_core
from engine.routing.prefix_reuse import PrefixReuse, ReuseCounts, make_prefix_reuse
from tests.routing.test_placement import PREFIX, cache, policy_with, request

COMPILED = compiled_core("_reuse", "PrefixReuse", "auto")
CORES = ["python", pytest.param("compiled", marks=pytest.mark.skipif(COMPILED is None, reason="_reuse not built"))]


def counts(core: str, halflife_s: float, capacity: int = 1 << 16) -> ReuseCounts:
    made: ReuseCounts = (PrefixReuse if core == "python" else COMPILED)(halflife_s, capacity)  # type: ignore[misc]
    return made


@pytest.mark.parametrize("core", CORES)
def test_counts_decay_with_the_half_life_and_the_oldest_prefix_goes_first(core: str) -> None:
    reuse = counts(core, halflife_s=10.0, capacity=2)
    assert reuse.observe(b"a", 0.0) == 1.0
    assert reuse.observe(b"a", 10.0) == pytest.approx(1.5)  # 1 halved, plus this one
    assert reuse.observe(b"a", 10.0) == pytest.approx(2.5)
    reuse.observe(b"b", 11.0)
    reuse.observe(b"c", 12.0)  # over capacity: "a", reused least recently, is dropped
    assert len(reuse) == 2
    assert reuse.observe(b"a", 12.0) == 1.0
    with pytest.raises(ValueError, match="halflife_s"):
        counts(core, 0.0)


@pytest.mark.parametrize("core", CORES)
def test_a_request_reuses_the_deepest_prefix_a_worker_holds(core: str) -> None:
    reuse = counts(core, halflife_s=10.0)
    hashes = [b"h0", b"h1", b"h2", b"h3"]
    assert reuse.reused(hashes, 4, 0, {}, 0.0) == 0.0  # nobody holds any of it: nothing counted
    assert reuse.reused(hashes, 4, 12, {"w0": 8}, 0.0) == 1.0  # the deepest depth 12: keyed by h2
    assert reuse.observe(b"h2", 0.0) == 2.0
    assert reuse.reused(hashes, 4, 0, {"w1": 4}, 0.0) == 1.0  # no depths: the hit, h0
    assert reuse.reused(hashes, 4, 0, {"w1": 40}, 0.0) == 1.0  # capped at the prompt: h3


@pytest.mark.skipif(COMPILED is None, reason="_reuse not built")
def test_the_compiled_counts_equal_the_reference_call_by_call() -> None:
    """Random reuses and requests, time read out of order too, a small capacity (prefixes dropped
    often): the compiled counts return exactly the reference's, and keep as many prefixes."""
    rng = random.Random(5)
    ref, fast = counts("python", 3.0, capacity=8), counts("compiled", 3.0, capacity=8)
    keys = [bytes([i]) * 4 for i in range(14)]
    now = 0.0
    for _ in range(4000):
        now += rng.choice((0.0, 0.01, 0.5, 2.0, -0.3))
        if rng.random() < 0.5:
            key = rng.choice(keys)
            assert fast.observe(bytes(bytearray(key)), now) == ref.observe(key, now)
        else:
            hashes = rng.sample(keys, rng.randrange(0, 6))
            depth = rng.choice((0, 0, 4, 8, 13, 40))
            hits = {f"w{i}": rng.choice((4, 8, 12, 30)) for i in range(rng.randrange(3))}
            assert fast.reused(hashes, 4, depth, hits, now) == ref.reused(hashes, 4, depth, hits, now)
        assert len(fast) == len(ref)
    assert type(make_prefix_reuse(1.0, "compiled")) is COMPILED
    assert type(make_prefix_reuse(1.0, "python")) is PrefixReuse


def _holder_with_a_long_queue(**knobs: object) -> list[str]:
    """w0 holds PREFIX and its queue is far over the instantaneous guard's limit each time one of
    three requests with it arrives (10 s apart: the reuse count stays below 2; at once: 2, 3)."""
    gap = float(knobs.pop("gap_s", 10.0))  # type: ignore[arg-type]
    policy = policy_with(4, imbalance_ratio=1.0, imbalance_slack_tokens=0.0, work_imbalance_ratio=0.0, **knobs)
    cache(policy, "w0", PREFIX)
    out = []
    for i in range(3):
        policy.update_load("w0", WorkerLoad(queued_tokens=500))  # limit: 125 mean + 201 tokens
        out.append(str(policy.route(request(f"r{i}", [*PREFIX, 1000 + i]), now=gap * i).prefill_worker))
    return out


def test_a_family_of_its_own_keeps_its_holder_past_the_queue_guard() -> None:
    """500 queued tokens cost 250, less than the 200-token hit at the family weight (4 x 200):
    the family stays; reused many times, the prefix is popular and the guard moves it."""
    assert _holder_with_a_long_queue() == ["w0", "w0", "w0"]
    assert "w0" not in _holder_with_a_long_queue(family_min_reuse=0.0)  # the rule off: guarded
    popular = _holder_with_a_long_queue(gap_s=0.0)
    assert popular[0] == "w0" and "w0" not in popular[1:]  # the second request reuses it again


def test_a_family_of_its_own_still_moves_when_waiting_costs_more_than_its_hit() -> None:
    policy = policy_with(4, imbalance_ratio=1.0, imbalance_slack_tokens=0.0, work_imbalance_ratio=0.0)
    cache(policy, "w0", PREFIX)
    policy.update_load("w0", WorkerLoad(queued_tokens=2000))  # 1,000 of load vs 3 x 200 for its hit
    decision = policy.route(request("r", [*PREFIX, 1]))
    assert decision.prefill_worker != "w0" and decision.best_hit == 200
