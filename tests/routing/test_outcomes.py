"""Route decisions counted per reason as hit / miss / below the best worker's predicted hit."""

from __future__ import annotations

from engine.routing import PrefixTreePolicy, RouteOutcomes, WorkerLoad
from tests.routing.test_placement import GROUPS, PREFIX, cache, policy_with, request


def test_a_warmed_prefix_sent_to_a_cold_worker_counts_as_a_miss_below_the_best() -> None:
    policy = policy_with(2, inflight_ttl_s=0.0)  # w1 gets no credit for the prompt sent to it
    cache(policy, "w0", PREFIX)
    outcomes = RouteOutcomes()
    policy.update_load("w0", WorkerLoad(queued_tokens=5000, running_requests=8))  # the holder is swamped
    away = policy.route(request("a", [*PREFIX, 1]))
    assert (away.prefill_worker, away.predicted_hit, away.best_hit) == ("w1", 0, 200)
    outcomes.record(away)
    policy.update_load("w0", WorkerLoad())
    policy.update_load("w1", WorkerLoad())
    home = policy.route(request("b", [*PREFIX, 2]))
    assert (home.prefill_worker, home.predicted_hit, home.best_hit) == ("w0", 200, 200)
    outcomes.record(home)
    assert outcomes.as_dict() == {
        "cost": {"hit": 0, "miss": 1, "below_best": 1},
        "prefix": {"hit": 1, "miss": 0, "below_best": 0},
    }


def test_pd_decisions_carry_the_best_prefill_hit_and_baselines_none() -> None:
    policy = policy_with(0)
    for worker, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        policy.add_worker(worker, role)  # type: ignore[arg-type]
    cache(policy, "p1", PREFIX)
    decision = policy.route(request("r", PREFIX + list(range(500, 520))))
    assert (decision.prefill_worker, decision.predicted_hit, decision.best_hit) == ("p1", 200, 200)
    tree = PrefixTreePolicy(GROUPS)
    tree.add_worker("w0")
    tree.route(request("a", [*PREFIX, 1]))
    assert tree.route(request("b", [*PREFIX, 2])).best_hit == 0  # the tree does not know
    outcomes = RouteOutcomes()
    outcomes.record(decision)
    assert outcomes.as_dict() == {"prefix": {"hit": 1, "miss": 0, "below_best": 0}}
