"""The compiled load book (``engine/routing/_load.c``) against ``PyLoadBook``, call by call: random
sequences of workers joining and leaving, load reports, assigned work, clock advances, guard
queries and scans must give bit-identical floats, identical workers and identical random draws
(the load order's tie-breaking), and ``PyLoadBook.scan`` against a brute-force argmin."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from configs.schema import RouterConfig
from engine.routing.load import Knobs, LoadBook, PyLoadBook, knobs_of, make_load_book
from engine.routing.types import Decision, WorkerLoad


def knobs(load_halflife_s: float, work_halflife_s: float, seed: int, **changes: float) -> Knobs:
    base = knobs_of(RouterConfig(seed=seed, load_halflife_s=load_halflife_s))
    return base._replace(work_halflife_s=work_halflife_s, **changes)


def compiled_book(knobs: Knobs) -> LoadBook:
    return make_load_book(knobs, core="compiled")


def test_the_compiled_book_is_built() -> None:
    book = make_load_book(knobs(5.0, 10.0, 0), core="auto")
    assert type(book).__module__ == "engine.routing._load", (
        "engine.routing._load is not built: run `python setup.py build_ext --inplace`"
    )


def test_bad_knobs_name_the_field() -> None:
    for make in (PyLoadBook, compiled_book):
        with pytest.raises(ValueError, match="work_halflife_s"):
            make(knobs(5.0, 0.0, 0))
    with pytest.raises(ValueError, match="core"):
        make_load_book(knobs(5.0, 10.0, 0), core="fast")


@pytest.mark.parametrize("work_imbalance_ratio", [0.0, 1.3])
@pytest.mark.parametrize("load_halflife_s", [0.0, 2.0])
@pytest.mark.parametrize("seed", range(4))
def test_compiled_and_python_books_agree_call_by_call(
    seed: int, load_halflife_s: float, work_imbalance_ratio: float
) -> None:
    rng = random.Random(seed)
    ref = PyLoadBook(knobs(load_halflife_s, 3.0, seed, work_imbalance_ratio=work_imbalance_ratio))
    fast = compiled_book(knobs(load_halflife_s, 3.0, seed, work_imbalance_ratio=work_imbalance_ratio))
    queued: dict[str, float] = {}
    cost: dict[str, float] = {}
    now = 0.0
    scans = 0
    for step in range(3000):
        worker = f"w{rng.randrange(40)}"
        op = rng.random()
        if rng.random() < 0.3:
            now += rng.random() * 0.5
        if worker not in queued:
            for book in (ref, fast):
                book.add(worker)
            queued[worker] = 0.0
            cost[worker] = 0.0
            continue
        if op < 0.03:
            for book in (ref, fast):
                book.remove(worker)
            del queued[worker], cost[worker]
        elif op < 0.35:
            queued[worker] = float(rng.choice([0, 0, 16, 64, rng.randrange(500)]))
            cost[worker] = float(rng.randrange(4)) if rng.random() < 0.5 else 0.5 * queued[worker]
            for book in (ref, fast):
                book.set_load(worker, queued[worker], cost[worker])
        elif op < 0.55:
            amount = float(rng.choice([0, 40, rng.randrange(1, 300)]))
            at = now - rng.random() if rng.random() < 0.1 else now  # a late time is clamped
            for book in (ref, fast):
                book.add_work(worker, amount, at)
        elif op < 0.65:
            for book in (ref, fast):
                book.advance(now)
        elif op < 0.75:
            slow, cap = rng.choice([math.inf, 10.0, 100.0]), rng.choice([math.inf, 20.0, 200.0])
            assert ref.smoothed(worker, now) == fast.smoothed(worker, now)
            assert ref.work(worker, now) == fast.work(worker, now)
            assert ref.smoothed_mean(now) == fast.smoothed_mean(now)
            assert ref.work_mean(now) == fast.work_mean(now)
            assert ref.over(worker, now, slow, cap) == fast.over(worker, now, slow, cap)
            n = rng.randrange(1, 3000)
            means = (rng.random() * 500, rng.choice([None, rng.random() * 400]), rng.choice([None, rng.random() * 900]))
            assert ref.thresholds(n, now, *means) == fast.thresholds(n, now, *means)
        else:
            names = sorted(queued)
            hits = {w: rng.choice([16, 32, 48, 200]) for w in rng.sample(names, min(len(names), rng.randrange(5)))}
            shared = {w: hits.get(w, 0) + rng.choice([0, 16, 64]) for w in rng.sample(names, min(len(names), 2))}
            deduct = {w: rng.random() * 20 for w in rng.sample(names, min(len(names), 2))}
            ahead = {w: rng.choice([0, 16, 100, 400]) for w in rng.sample(names, min(len(names), 2))}
            parts = (hits, rng.choice([None, shared]), rng.choice([None, deduct]), rng.choice([None, {}, ahead]))
            credit = ref.credit(*parts)  # type: ignore[arg-type]
            other = fast.credit(*parts)  # type: ignore[arg-type]
            assert credit == other and list(credit) == list(other)  # the same keys, values and order
            assert all(type(credit[w]) is type(other[w]) for w in credit)
            among: object = queued if rng.random() < 0.7 else set(rng.sample(names, max(1, len(names) // 2)))
            pending = set(rng.sample(sorted(credit), min(len(credit), 1))) if rng.random() < 0.2 else ()
            limit = rng.choice([math.inf, 100.0, 300.0, 0.0, 16.0])  # (low: the load order is probed deep)
            slow, cap = rng.choice([math.inf, 10.0]), rng.choice([math.inf, 50.0])
            w_uncached = rng.choice([2.0, 0.1])
            probes = rng.choice([-1, len(credit) + 1, len(credit) + 8, 30, 70])
            args = (credit, among, cost, queued, limit, now, slow, cap, w_uncached, 1.0, pending, probes)
            a, b = ref.scan(*args), fast.scan(*args)  # type: ignore[arg-type]
            assert a == b, (step, a, b)
            scans += 1
    assert scans > 500


@pytest.mark.parametrize("core", ["python", "compiled"])
def test_scan_is_the_brute_force_argmin(core: str) -> None:
    rng = random.Random(11)
    book = make_load_book(knobs(0.0, 5.0, 3), core=core)
    queued: dict[str, float] = {}
    cost: dict[str, float] = {}
    for k in range(30):
        name = f"w{k}"
        book.add(name)
        queued[name] = float(rng.randrange(0, 400))
        cost[name] = float(rng.randrange(0, 6))
        book.set_load(name, queued[name], cost[name])
    previous: tuple[object, ...] = ()
    copied: tuple[object, ...] = ()
    for _ in range(300):
        credit: dict[str, float] = {w: float(rng.randrange(1, 5)) for w in rng.sample(sorted(queued), 4)}
        limit = rng.choice([150.0, 300.0, math.inf])
        result = book.scan(credit, queued, cost, queued, limit, 0.0, math.inf, math.inf, 2.0, 1.0, (), len(queued))
        if previous:  # each result is the caller's: a later scan leaves it as it was
            assert previous == copied
        previous, copied = result, tuple(type(x)(x) if isinstance(x, (list, set)) else x for x in result)
        best_cost, best, deferred, spread, guarded, fresh = result
        allowed = {w: cost[w] - 2.0 * credit.get(w, 0.0) for w in queued if queued[w] <= limit}
        assert not deferred and not spread
        if all(q <= limit for q in queued.values()):
            assert not guarded
        if any(queued[w] > limit for w in credit):
            assert guarded
        assert best_cost == min(allowed.values())
        # every holder at the minimum is kept; of the workers without a prefix, the least loaded
        assert {w for w in credit if w in allowed and allowed[w] <= best_cost + 1e-9} <= set(best)
        assert all(allowed[w] <= best_cost + 1e-9 for w in best)
        others = [w for w in allowed if w not in credit]
        assert fresh == bool(others)
        assert len([w for w in best if w not in credit]) <= 1
        if others and min(cost[w] for w in others) <= best_cost + 1e-9:
            assert any(w not in credit for w in best)


@pytest.mark.parametrize("core", ["python", "compiled"])
def test_the_load_order_is_probed_in_increasing_order(core: str) -> None:
    """The least loaded worker within the limit among the ``probes`` least loaded, found deep in
    the load order (most workers over the limit) after many workers moved, left and came back:
    against a sort of the costs (distinct, no work: the order is by cost alone)."""
    rng = random.Random(5)
    book = make_load_book(knobs(0.0, 5.0, 7), core=core)
    queued: dict[str, float] = {}
    cost: dict[str, float] = {}
    for step in range(4000):
        name = f"w{rng.randrange(120)}"
        if name not in queued:
            book.add(name)
            queued[name], cost[name] = 0.0, 0.0
        elif rng.random() < 0.05:
            book.remove(name)
            del queued[name], cost[name]
            continue
        queued[name] = float(rng.randrange(1000))
        cost[name] = rng.random() * 100
        book.set_load(name, queued[name], cost[name])
        if step % 10:
            continue
        limit = float(rng.choice([20, 100, 400]))
        probes = rng.choice([1, 5, 40, 90])
        exclude = {w: 1.0 for w in rng.sample(sorted(queued), min(len(queued), 3))}
        ordered = sorted(queued, key=cost.__getitem__)[:probes]
        candidates = [w for w in ordered if w not in exclude]
        allowed = [w for w in candidates if queued[w] <= limit]
        # ``exclude`` plays the prefix holders (the credit: the load order skips them), none of
        # them a candidate here (``among`` is empty)
        _, best, _, _, guarded, fresh = book.scan(
            exclude, {}, cost, queued, limit, 0.0, math.inf, math.inf, 2.0, 1.0, (), probes
        )
        assert fresh == bool(allowed) and best == allowed[:1], (step, probes, best, allowed[:1])
        refused = candidates[: candidates.index(allowed[0])] if allowed else candidates
        assert guarded == any(queued[w] > limit for w in refused)


@pytest.mark.parametrize("seed", range(3))
def test_place_is_choose_then_assign(seed: int) -> None:
    """The compiled ``place`` against the compiled ``choose`` then ``assign`` on a twin book (each
    checked against the Python reference elsewhere: ``choose`` and ``assign`` in
    test_core_parity.py, the book's state call by call above): the same worker, reason, hit, best
    hit and queue change, and afterwards the same loads, policy dicts, book state and draws."""
    rng = random.Random(seed)
    made = knobs(2.0, 3.0, seed, work_imbalance_ratio=1.3)
    assert (
        PyLoadBook(made).place({}, None, None, (), {}, {}, 0.0, 10, 0.0, 2.0, 1.0, 2, rng.randrange, {}, Decision)
        is None
    )
    books = (compiled_book(made), compiled_book(made))
    draws = (random.Random(seed), random.Random(seed))
    names = [f"w{k}" for k in range(12)]
    states = []
    for _ in books:
        loads = {w: WorkerLoad(float(k % 3) * 40, k % 2, 0.1 * k) for k, w in enumerate(names)}
        states.append((loads, {w: 0.0 for w in names}, {w: 0.0 for w in names}))
    for book in books:
        for w in names:
            book.add(w)
    placed_some = False
    now = 0.0
    for _ in range(400):
        now += rng.random() * 0.2
        hits = {w: rng.choice([0, 16, 48, 200]) for w in rng.sample(names, rng.randrange(4))}
        shared = rng.choice([None, {w: hits.get(w, 0) + 16 for w in rng.sample(names, 2)}])
        ahead = rng.choice([None, {}, {w: rng.choice([0, 16, 400]) for w in rng.sample(names, 2)}])
        pending = set(rng.sample(sorted(hits), min(len(hits), 1))) if rng.random() < 0.1 else ()
        n = rng.randrange(1, 600)
        mean = rng.random() * 100
        out = []
        for book, draw, (loads, cost, queued) in zip(books, draws, states, strict=True):
            common = (hits, shared, ahead, pending, cost, queued, mean, n, now, 2.0, 1.0, 2, draw.randrange)
            if book is books[0]:
                placed = book.place(*common, loads, Decision)
                if placed is not None:
                    decision, delta = placed
                    assert type(decision) is Decision and type(decision.reason) is str
                    assert dataclasses.replace(decision) == decision and hash(decision) == hash(
                        dataclasses.replace(decision)
                    )
                    placed = (
                        decision.prefill_worker,
                        decision.reason,
                        decision.predicted_hit,
                        decision.best_hit,
                        delta,
                    )
                    assert decision == Decision(placed[0], placed[0], placed[2], n, placed[1], None, 0, placed[3], 0)
                out.append(placed)
                continue
            chosen = book.choose(*common)
            if chosen is None:
                out.append(None)
                continue
            worker, reason = chosen
            hit = hits.get(worker, 0)
            delta = book.assign(worker, loads[worker], n - hit, now, cost, queued)
            out.append((worker, reason, hit, max(hits.values(), default=0), delta))
        assert out[0] == out[1]
        placed_some |= out[0] is not None
        assert states[0][1] == states[1][1] and states[0][2] == states[1][2]
        assert states[0][0] == states[1][0]
        for w in names:
            assert books[0].work(w, now) == books[1].work(w, now)
            assert books[0].smoothed(w, now) == books[1].smoothed(w, now)
        if rng.random() < 0.3:  # a load report
            w, q, c = rng.choice(names), float(rng.randrange(300)), float(rng.randrange(5))
            for book, (loads, cost, queued) in zip(books, states, strict=True):
                loads[w] = WorkerLoad(q, 1, 0.5)
                cost[w], queued[w] = c, q
                book.set_load(w, queued[w], cost[w])
    assert placed_some
    assert draws[0].random() == draws[1].random()  # the same tie draws were made
