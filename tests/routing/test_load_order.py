"""The load order the policy takes its least loaded worker from, against a brute-force minimum."""

from __future__ import annotations

import math
import random

from engine.routing.load import DecayedWork, LoadOrder


def test_first_is_the_least_loaded_then_least_worked_allowed_worker() -> None:
    rng = random.Random(4)
    order = LoadOrder(seed=1)
    work = DecayedWork(halflife_s=2.0)
    costs: dict[str, float] = {}
    now = 0.0
    for step in range(4000):
        now += rng.random() * 0.1
        worker = f"w{rng.randrange(60)}"
        op = rng.random()
        if op < 0.05 and worker in costs:
            order.remove(worker)
            work.remove(worker)
            del costs[worker]
            continue
        if worker not in costs:
            work.add_worker(worker)
        if op < 0.5:
            work.add(worker, rng.choice([0.0, 10.0, 100.0]), now)
        costs[worker] = float(rng.randrange(4))  # few distinct costs: ties are common
        order.set(worker, costs[worker], work.rank(worker))
        if step % 7 or not costs:
            continue
        exclude = set(rng.sample(sorted(costs), min(len(costs), 3)))
        refused = set(rng.sample(sorted(costs), min(len(costs), 2)))
        allowed = [w for w in costs if w not in exclude and w not in refused]
        found, was_refused = order.first(
            exclude, lambda w, refused=refused: w not in refused, len(exclude) + len(refused) + 1
        )
        if not allowed:
            assert found is None
            continue
        least = min((costs[w], work.get(w, now)) for w in allowed)
        assert found in allowed
        assert costs[found] == least[0] and math.isclose(work.get(found, now), least[1], rel_tol=1e-9, abs_tol=1e-9)
        mine = work.get(found, now)
        smaller = [
            w
            for w in refused - exclude
            if costs[w] < costs[found] or (costs[w] == costs[found] and work.get(w, now) < mine - 1e-9 * (1 + mine))
        ]
        assert was_refused or not smaller  # a smaller worker the guard refused is reported


def test_exact_ties_are_broken_at_random_and_the_heap_stays_bounded() -> None:
    order = LoadOrder(seed=0)
    for i in range(50):
        order.set(f"w{i}", 0.0, -math.inf)
    picks = set()
    for _ in range(200):
        found, _ = order.first((), lambda w: True, 4)
        assert found is not None
        picks.add(found)
        order.set(found, 1.0, 0.0)  # it took work: no longer least
        order.set(found, 0.0, -math.inf)  # and went idle again, with a new draw
    assert len(picks) > 10
    assert len(order._heap) <= 4 * len(order) + 64
