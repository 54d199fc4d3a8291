"""The load guards: a prefix spreads from its holder only when the holder's load costs more than
recomputing the prefix elsewhere; new prefixes go where recent work is not.

The first test is serve_bench's shape (benchmarks/serve_bench.py at 1 req/s), where kvfleet used
to send warmed prefixes to a prefill worker without them while their holder was idle.
"""

from __future__ import annotations

import random
from collections import Counter

from engine.kv_cache.hashing import block_hashes
from engine.routing import (
    PlacementPolicy,
    PrefixTreePolicy,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
)
from tests.routing.helpers import router_config
from tests.routing.test_placement import GROUPS, PREFIX, cache, policy_with, request

PREFIX_TOKENS = 256
NUM_PREFIXES = 5
REQUESTS_PER_PREFIX = 16
PD_WORKERS = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}


def shared_prefix_workload(seed: int = 0) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """5 prefixes of 256 tokens, each asked 16 distinct 16-token questions, shuffled (seeded)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50, 5000) for _ in range(PREFIX_TOKENS)] for _ in range(NUM_PREFIXES)]
    prompts = [
        (i, prefixes[i] + [rng.randrange(50, 5000) for _ in range(16)])
        for i in range(NUM_PREFIXES)
        for _ in range(REQUESTS_PER_PREFIX)
    ]
    rng.shuffle(prompts)
    return prefixes, prompts


def pd_cluster(router: PlacementPolicy) -> PlacementPolicy:
    for worker, role in PD_WORKERS.items():
        router.add_worker(worker, role)  # type: ignore[arg-type]
    return router


def route_idle(router: PlacementPolicy, rid: str, prompt: list[int], now: float) -> str:
    """Route one request, then every worker reports an empty queue (it finished before the next
    arrival, as at 1 req/s with a TTFT of a quarter second)."""
    decision = router.route(RouteRequest(rid, block_hashes(prompt, 4), len(prompt)), now)
    for worker in PD_WORKERS:
        router.update_load(worker, WorkerLoad())
    assert decision.prefill_worker != decision.decode_worker
    return str(decision.prefill_worker)


def test_a_warmed_prefix_stays_on_its_idle_prefill_holder() -> None:
    """2 prefill + 2 decode workers; each prefix computed once (p0 holds three, p1 two: a pool
    holds about half the prefix set); 80 requests, one a second, each worker idle at every
    arrival. The approximate tree sends every request to the worker it sent the prefix to, and
    kvfleet must too: recomputing a warmed prefix elsewhere costs a second of TTFT, waiting at an
    idle holder nothing. (It did not: the work guard compared each prefill worker with the mean
    over all four workers, decode workers included, and left the idle holder out.)"""
    prefixes, prompts = shared_prefix_workload()
    tree = pd_cluster(PrefixTreePolicy(GROUPS))
    placed = [route_idle(tree, f"warm{i}", [*prefix, 1, 2, 3], float(i)) for i, prefix in enumerate(prefixes)]
    start = float(len(prefixes))
    tree_choices = [route_idle(tree, f"r{n}", p, start + n) for n, (_, p) in enumerate(prompts)]
    assert tree_choices == [placed[i] for i, _ in prompts]

    policy = pd_cluster(RoutingPolicy(GROUPS))
    assert isinstance(policy, RoutingPolicy)
    holder = {0: "p0", 1: "p0", 2: "p0", 3: "p1", 4: "p1"}
    for i, prefix in enumerate(prefixes):
        cache(policy, holder[i], prefix)
    choices = []
    for n, (_, prompt) in enumerate(prompts):
        worker = route_idle(policy, f"r{n}", prompt, start + n)
        cache(policy, worker, prompt)  # the worker reports the prompt's blocks
        choices.append(worker)
    misplaced = [
        (n, i, worker) for n, ((i, _), worker) in enumerate(zip(prompts, choices, strict=False)) if worker != holder[i]
    ]
    assert misplaced == []


def test_new_prefixes_go_to_the_worker_with_the_least_recent_work() -> None:
    """Sequential first sights on idle workers (serve_bench's warm-up) split the prefixes 3/2 over
    two prefill workers for every seed, so neither pool has to hold more than its share (a
    random tie-break put four of five on one worker in a third of the seeds)."""
    prefixes, _ = shared_prefix_workload()
    for seed in range(10):
        policy = pd_cluster(RoutingPolicy(GROUPS, router_config(seed=seed)))
        placed = Counter(route_idle(policy, f"w{i}", [*p, 1, 2, 3], float(i)) for i, p in enumerate(prefixes))
        assert sorted(placed.values()) == [2, 3], (seed, placed)


def test_an_idle_holder_keeps_its_prefix_however_much_work_it_took() -> None:
    """The work guard marks a holder that took more than its share; with nothing queued there the
    holder still costs less than recomputing the prefix elsewhere, so the prefix stays."""
    policy = policy_with(4, work_imbalance_ratio=1.3, work_halflife_s=10.0)
    cache(policy, "w0", PREFIX)
    chosen = []
    for i in range(12):
        chosen.append(str(policy.route(request(f"r{i}", [*PREFIX, 1000 + i]), now=0.1 * i).prefill_worker))
        policy.update_load("w0", WorkerLoad())  # finished at once: the holder stays idle
    assert set(chosen) == {"w0"}


def test_work_guard_spreads_a_busy_holder_that_keeps_taking_more_than_its_share() -> None:
    """A holder with a queue whose cost is between the compute its hit saves (1x) and that plus
    the churn a copy elsewhere causes (2x): cost alone keeps the prefix there; once the holder
    has taken more than ``work_imbalance_ratio`` x the mean of recent work, the churn credit is
    dropped and the prefix spreads. Work long past has decayed: no spreading."""

    def chosen(ratio: float, gap_s: float = 0.1) -> list[str]:
        policy = policy_with(
            4,
            w_running=0.0,
            w_used=0.0,
            imbalance_ratio=1e9,
            load_halflife_s=0.0,
            work_imbalance_ratio=ratio,
            work_halflife_s=1.0,
        )
        cache(policy, "w0", PREFIX)
        out = []
        for i in range(12):
            policy.update_load("w0", WorkerLoad(queued_tokens=600))  # 300 of load vs a 200-token hit
            out.append(str(policy.route(request(f"r{i}", [*PREFIX, 1000 + i]), now=gap_s * i).prefill_worker))
        return out

    assert set(chosen(0.0)) == {"w0"}  # off: 300 - 2 x 200 < 0, the holder wins on cost
    spread = chosen(1.3)
    assert spread[0] == "w0" and spread.count("w0") >= 3 and len(set(spread)) >= 2
    assert set(chosen(1.3, gap_s=100.0)) == {"w0"}


def test_sustained_guard_spreads_a_holder_whose_queue_stays_long() -> None:
    """Below the instantaneous guard, a holder whose queue stays long for seconds loses its churn
    credit; it keeps the prefix only while its queue costs less than recomputing it elsewhere."""

    def chosen(load_halflife_s: float, queued: float) -> list[str]:
        policy = policy_with(
            4,
            w_running=0.0,
            w_used=0.0,
            imbalance_ratio=1e9,
            load_halflife_s=load_halflife_s,
            sustained_imbalance_ratio=1.3,
            work_imbalance_ratio=0.0,
        )
        cache(policy, "w0", PREFIX)
        out = []
        for i in range(20):
            policy.update_load("w0", WorkerLoad(queued_tokens=queued))  # busy all along
            for other in ("w1", "w2", "w3"):
                policy.update_load(other, WorkerLoad())  # the others keep up with what they get
            out.append(str(policy.route(request(f"r{i}", [*PREFIX, 1000 + i]), now=0.5 * i).prefill_worker))
        return out

    assert set(chosen(0.0, 600.0)) == {"w0"}  # no time average: cost alone keeps the prefix
    spread = chosen(1.0, 600.0)
    assert spread[0] == "w0" and "w0" not in spread[4:] and len(set(spread)) >= 2
    # a queue of 300 tokens costs 150, less than the 200 tokens its hit saves: the prefix stays
    assert set(chosen(1.0, 300.0)) == {"w0"}
