"""P/D under load on a local Ray cluster: concurrent waves of shared-prefix requests while other
processes keep the cores busy; every request gets exactly the tokens of a single engine that
ran the prompt alone (the bug this guards against: under CPU load, tiny-hybrid 2P+2D returned wrong
tokens; tests/engine/test_pd_race.py has its cause).

The default run is bounded for CI: tiny-hybrid 2P+2D over NIXL (where the wrong tokens were
seen), 32 requests beside one busy process. ``KVFLEET_PD_STRESS=long`` runs every preset x
backend x shape with 96 requests beside two; ``benchmarks/pd_stress.py`` runs longer still.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from kvfleet_testing.pd_stress import busy_cpu, run_cluster_stress

LONG = os.environ.get("KVFLEET_PD_STRESS", "") == "long"
HAS_NIXL = importlib.util.find_spec("nixl") is not None

if LONG:
    BUSY = 2
    CASES = [
        (preset, backend, shape, 96)
        for preset in ("tiny", "tiny-hybrid")
        for backend in ("local", "nixl")
        for shape in ((1, 1), (2, 2))
    ]
else:
    BUSY = 1
    CASES = [("tiny-hybrid", "nixl" if HAS_NIXL else "local", (2, 2), 32)]


@pytest.mark.parametrize(
    "preset, backend, shape, requests", CASES, ids=[f"{p}-{b}-{s[0]}P{s[1]}D-{n}" for p, b, s, n in CASES]
)
def test_pd_under_cpu_load_returns_the_single_engine_tokens(ray_session, preset, backend, shape, requests):
    if backend == "nixl" and not HAS_NIXL:
        pytest.skip("nixl is not installed")
    with busy_cpu(BUSY):
        result = run_cluster_stress(preset, backend, *shape, requests=requests, wave=16, seed=len(preset) + shape[0])
    assert result.requests == requests
    assert result.wrong_tokens == 0, result.mismatches
    assert result.disaggregated >= requests // 2, "most requests go through a prefill worker"
    assert result.transfer.get("reads", 0) > 0
