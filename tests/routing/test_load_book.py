"""The compiled load book (``engine/routing/_load.c``) against ``PyLoadBook``, call by call: random
sequences of workers joining and leaving, load reports (with promote costs), assigned work, clock
advances, guard queries, credits with host-tier hits and scans must give bit-identical floats,
identical workers and identical random draws (the load order's tie-breaking), and
``PyLoadBook.scan`` against a brute-force argmin."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from configs.schema import RouterConfig
from engine.routing.load import Knobs, LoadBook, knobs_of, make_load_book
from engine.routing.types import Decision, WorkerLoad


def knobs(load_halflife_s: float, work_halflife_s: float, seed: int, **changes: float) -> Knobs:
    base = knobs_of(RouterConfig(seed=seed, load_halflife_s=load_halflife_s))
    return base._replace(work_halflife_s=work_halflife_s, **changes)


class Twin:
    """One load book over its own load copies and tie draws (``random.Random(seed)``)."""

    def __init__(self, book: LoadBook, loads: dict[str, WorkerLoad], draw: random.Random):
        self.book, self.loads, self.draw = book, loads, draw


def twin(knobs: Knobs, core: str, seed: int = 0) -> Twin:
    loads: dict[str, WorkerLoad] = {}
    draw = random.Random(seed)
    return Twin(make_load_book(knobs, loads, draw.randrange, core), loads, draw)  # type: ignore[arg-type]


def compiled_book(knobs: Knobs) -> LoadBook:
    return twin(knobs, "compiled").book


def python_book(knobs: Knobs) -> LoadBook:
    return twin(knobs, "python").book


def test_the_compiled_book_is_built() -> None:
    book = twin(knobs(5.0, 10.0, 0), "auto").book
    assert type(book).__module__ == "engine.routing._load", (
        "engine.routing._load is not built: run `python setup.py build_ext --inplace`"
    )


def test_bad_knobs_name_the_field() -> None:
    for make in (python_book, compiled_book):
        with pytest.raises(ValueError, match="work_halflife_s"):
            make(knobs(5.0, 0.0, 0))
    with pytest.raises(ValueError, match="core"):
        twin(knobs(5.0, 10.0, 0), "fast")


def same_state(ref: Twin, fast: Twin, names: list[str], now: float) -> None:
    """The two books (and their load copies) hold the same numbers, in the same dict order."""
    assert list(ref.book.queued.items()) == list(fast.book.queued.items())
    assert list(ref.book.load_cost.items()) == list(fast.book.load_cost.items())
    assert ref.book.queued_sum == fast.book.queued_sum
    assert ref.loads == fast.loads
    for w in names:
        assert ref.book.work(w, now) == fast.book.work(w, now)
        assert ref.book.smoothed(w, now) == fast.book.smoothed(w, now)


@pytest.mark.parametrize("work_imbalance_ratio", [0.0, 1.3])
@pytest.mark.parametrize("load_halflife_s", [0.0, 2.0])
@pytest.mark.parametrize("seed", range(4))
def test_compiled_and_python_books_agree_call_by_call(
    seed: int, load_halflife_s: float, work_imbalance_ratio: float
) -> None:
    """Random sequences of every call of the interface on both books: the same results and, after
    each call, the same state (``same_state``)."""
    rng = random.Random(seed)
    made = knobs(load_halflife_s, 3.0, seed, work_imbalance_ratio=work_imbalance_ratio)
    ref, fast = twin(made, "python", seed), twin(made, "compiled", seed)
    pair = (ref, fast)
    now = 0.0
    scans = placed = 0
    for step in range(3000):
        worker = f"w{rng.randrange(40)}"
        names = sorted(ref.book.queued)
        op = rng.random()
        if rng.random() < 0.3:
            now += rng.random() * 0.5
        if worker not in ref.book.queued:
            for t in pair:
                t.loads[worker] = WorkerLoad()
                t.book.add(worker)
            continue
        if op < 0.03:
            for t in pair:
                t.book.remove(worker)
                del t.loads[worker]
        elif op < 0.3:
            queued = rng.choice([0, 0, 16, 64, rng.randrange(500), 0.5 * rng.randrange(900)])
            promote = rng.choice([0.0, 0.0, rng.random() * 1e-5, 5.2e-6, rng.random() * 1e-3])
            load = WorkerLoad(queued, rng.randrange(4), rng.random(), promote)
            for t in pair:
                t.loads[worker] = dataclasses.replace(load)
                t.book.report(worker, t.loads[worker])
        elif op < 0.45:
            amount = float(rng.choice([0, 40, rng.randrange(1, 300)]))
            at = now - rng.random() if rng.random() < 0.1 else now  # a late time is clamped
            for t in pair:
                t.book.add_work(worker, amount, at)
        elif op < 0.5:
            uncached = rng.choice([0, 16, rng.randrange(1, 400)])
            for t in pair:
                t.book.assign(worker, uncached, now)
        elif op < 0.55:
            for t in pair:
                t.book.advance(now)
        elif op < 0.65:
            slow, cap = rng.choice([math.inf, 10.0, 100.0]), rng.choice([math.inf, 20.0, 200.0])
            a, b = ref.book, fast.book
            assert a.smoothed_mean(now) == b.smoothed_mean(now) and a.work_mean(now) == b.work_mean(now)
            assert a.over(worker, now, slow, cap) == b.over(worker, now, slow, cap)
            for w in (worker, "absent"):  # (a worker without a load copy: no promote cost)
                assert a.promote_load(w) == b.promote_load(w)
            n = rng.randrange(1, 3000)
            means = tuple(rng.choice([None, rng.random() * 500]) for _ in range(3))
            assert a.thresholds(n, now, *means) == b.thresholds(n, now, *means)
        elif op < 0.8:
            hits = {w: rng.choice([16, 32, 48, 200]) for w in rng.sample(names, min(len(names), rng.randrange(5)))}
            shared = {w: hits.get(w, 0) + rng.choice([0, 16, 64]) for w in rng.sample(names, min(len(names), 2))}
            host = {w: min(hits.get(w, 16), rng.choice([0, 16, 48])) for w in rng.sample(names, min(len(names), 3))}
            ahead = {w: rng.choice([0, 16, 100, 400]) for w in rng.sample(names, min(len(names), 2))}
            parts = (hits, rng.choice([None, shared]), rng.choice([None, {}, host]), rng.choice([None, {}, ahead]))
            credit = ref.book.credit(*parts)  # type: ignore[arg-type]
            other = fast.book.credit(*parts)  # type: ignore[arg-type]
            assert credit == other and list(credit) == list(other)  # the same keys, values and order
            assert all(type(credit[w]) is type(other[w]) for w in credit)
            among: object = ref.book.queued if rng.random() < 0.7 else set(rng.sample(names, max(1, len(names) // 2)))
            pending = set(rng.sample(sorted(credit), min(len(credit), 1))) if rng.random() < 0.2 else ()
            limit = rng.choice([math.inf, 100.0, 300.0, 0.0, 16.0])  # (low: the load order is probed deep)
            slow, cap = rng.choice([math.inf, 10.0]), rng.choice([math.inf, 50.0])
            w_uncached = rng.choice([2.0, 0.1])
            probes = rng.choice([-1, len(credit) + 1, len(credit) + 8, 30, 70])
            args = (credit, among, limit, now, slow, cap, w_uncached, 1.0, pending, probes)
            a, b = ref.book.scan(*args), fast.book.scan(*args)  # type: ignore[arg-type]
            assert a == b, (step, a, b)
            scans += 1
        else:
            hits = {w: rng.choice([0, 16, 48, 200]) for w in rng.sample(names, min(len(names), rng.randrange(4)))}
            shared = rng.choice([None, {w: hits.get(w, 0) + 16 for w in rng.sample(names, min(len(names), 2))}])
            host = rng.choice([None, {}, {w: min(h, rng.choice([16, 48])) for w, h in hits.items() if h}])
            ahead = rng.choice([None, {}, {w: rng.choice([0, 16, 400]) for w in rng.sample(names, min(len(names), 2))}])
            pending = set(rng.sample(sorted(hits), min(len(hits), 1))) if rng.random() < 0.1 else ()
            n = rng.randrange(1, 600)
            # (guard False: a family of its own's pick, the instantaneous guard off)
            request = (hits, shared, host, ahead, pending, n, now, rng.choice([2.0, 1.25]), 1.0, rng.random() < 0.7)
            if rng.random() < 0.5:
                chosen = [t.book.choose(*request) for t in pair]  # type: ignore[arg-type]
                assert chosen[0] == chosen[1]
            else:
                decisions = [t.book.place(*request) for t in pair]  # type: ignore[arg-type]
                assert decisions[0] == decisions[1]
                placed += decisions[0] is not None
        same_state(ref, fast, sorted(ref.book.queued), now)
    assert scans > 300 and placed > 50
    assert ref.draw.random() == fast.draw.random()  # the same tie draws were made


@pytest.mark.parametrize("core", ["python", "compiled"])
def test_scan_is_the_brute_force_argmin(core: str) -> None:
    rng = random.Random(11)
    book = twin(by_used_share(knobs(0.0, 5.0, 3)), core).book
    queued: dict[str, float] = {}
    cost: dict[str, float] = {}
    for k in range(30):
        name = f"w{k}"
        book.add(name)
        queued[name] = float(rng.randrange(0, 400))
        cost[name] = float(rng.randrange(0, 6))
        book.report(name, WorkerLoad(queued[name], 0, cost[name]))
    previous: tuple[object, ...] = ()
    copied: tuple[object, ...] = ()
    for _ in range(300):
        credit: dict[str, float] = {w: float(rng.randrange(1, 5)) for w in rng.sample(sorted(queued), 4)}
        limit = rng.choice([150.0, 300.0, math.inf])
        result = book.scan(credit, queued, limit, 0.0, math.inf, math.inf, 2.0, 1.0, (), len(queued))
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
    book = twin(by_used_share(knobs(0.0, 5.0, 7)), core).book
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
        book.report(name, WorkerLoad(queued[name], 0, cost[name]))
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
        _, best, _, _, guarded, fresh = book.scan(exclude, {}, limit, 0.0, math.inf, math.inf, 2.0, 1.0, (), probes)
        assert fresh == bool(allowed) and best == allowed[:1], (step, probes, best, allowed[:1])
        refused = candidates[: candidates.index(allowed[0])] if allowed else candidates
        assert guarded == any(queued[w] > limit for w in refused)


@pytest.mark.parametrize("core", ["python", "compiled"])
@pytest.mark.parametrize("seed", range(3))
def test_place_is_choose_then_assign(seed: int, core: str) -> None:
    """``place`` against ``choose`` then ``assign`` on a twin book of the same core: the same
    decision (the worker both ways, its hit, the reason, the best hit, its host-tier hit), and
    afterwards the same loads, dicts, book state and draws."""
    rng = random.Random(seed)
    made = knobs(2.0, 3.0, seed, work_imbalance_ratio=1.3)
    pair = (twin(made, core, seed), twin(made, core, seed))
    names = [f"w{k}" for k in range(12)]
    for t in pair:
        for k, w in enumerate(names):
            t.loads[w] = WorkerLoad(float(k % 3) * 40, k % 2, 0.1 * k, [0.0, 5.2e-6, 1e-3][k % 3])
            t.book.add(w)
            t.book.report(w, t.loads[w])
    placed_some = False
    now = 0.0
    for _ in range(400):
        now += rng.random() * 0.2
        hits = {w: rng.choice([0, 16, 48, 200]) for w in rng.sample(names, rng.randrange(4))}
        shared = rng.choice([None, {w: hits.get(w, 0) + 16 for w in rng.sample(names, 2)}])
        ahead = rng.choice([None, {}, {w: rng.choice([0, 16, 400]) for w in rng.sample(names, 2)}])
        host = rng.choice([None, {}, {w: min(h, rng.choice([16, 48])) for w, h in hits.items() if h}])
        pending = set(rng.sample(sorted(hits), min(len(hits), 1))) if rng.random() < 0.1 else ()
        n = rng.randrange(1, 600)
        request = (hits, shared, host, ahead, pending, n, now, 2.0, 1.0)
        decision = pair[0].book.place(*request)  # type: ignore[arg-type]
        chosen = pair[1].book.choose(*request)  # type: ignore[arg-type]
        if chosen is None:
            assert decision is None
        else:
            worker, reason = chosen
            hit = hits.get(worker, 0)
            pair[1].book.assign(worker, n - hit, now)
            assert type(decision) is Decision and type(decision.reason) is str
            assert dataclasses.replace(decision) == decision and hash(decision) == hash(dataclasses.replace(decision))
            hosted = host.get(worker, 0) if host else 0
            assert decision == Decision(worker, worker, hit, n, reason, None, 0, max(hits.values(), default=0), hosted)
            placed_some = True
        same_state(pair[0], pair[1], names, now)
        if rng.random() < 0.3:  # a load report
            w, load = rng.choice(names), WorkerLoad(float(rng.randrange(300)), 1, 0.5, rng.choice([0.0, 2e-5]))
            for t in pair:
                t.loads[w] = dataclasses.replace(load)
                t.book.report(w, t.loads[w])
    assert placed_some
    assert pair[0].draw.random() == pair[1].draw.random()  # the same tie draws were made


def by_used_share(made: Knobs) -> Knobs:
    """Knobs whose load cost is the used share of blocks alone (a test sets it directly)."""
    return made._replace(w_queued=0.0, w_running=0.0, w_used=1.0)
