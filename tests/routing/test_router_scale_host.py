"""``benchmarks.router_scale``'s host-tier scenario on a small fleet: the simulated workers'
host tiers (``scale_fleet.FleetWorker``) keep what their devices evict, the router predicts
over both tiers exactly (accuracy 1.0 against the coordinator's fixed point over both tiers),
on the compiled core and the Python one alike (the same hit rate), and the host tier adds hits."""

from __future__ import annotations

from benchmarks import router_scale
from engine.routing.holder_maps import compiled_available

ARGV = [
    "--workers", "6", "--decisions", "160", "--prefixes-per-worker", "3", "--prefix-min", "64",
    "--prefix-max", "320", "--suffix-min", "16", "--suffix-max", "48", "--capacity", "160",
    "--repeats", "1", "--replicas",
]  # fmt: skip  # flag / value pairs on few lines


def test_host_tier_predictions_are_exact_and_add_hits() -> None:
    args = router_scale.parse_args(ARGV)
    routers = ["kvfleet", "python_core"] if compiled_available() else ["python_core"]
    tiered = {r: router_scale.run(args, 6, r, host=4).summary() for r in routers}
    plain = router_scale.run(args, 6, "python_core").summary()
    for summary in tiered.values():
        assert summary["accuracy"] == 1.0
    assert len({s["hit_rate"] for s in tiered.values()}) == 1
    assert tiered["python_core"]["hit_rate"] > plain["hit_rate"]
