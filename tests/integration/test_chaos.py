"""Chaos on 2P+2D: a few hundred requests at a steady rate while a decode worker, a prefill worker
and the router are killed at random moments (see ``kvfleet_testing/chaos.py``). Every request
completes with exactly the single engine's tokens or ends with a clear error before it streamed
anything wrong; none hangs; every worker has all its blocks back at the end; the cluster recovers
from each kill."""

from __future__ import annotations

import pytest

from kvfleet_testing.chaos import run_chaos


@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_chaos_kills_lose_no_request_and_leak_no_block(ray_session, backend: str) -> None:
    result = run_chaos(requests=150, rate=5.0, kills=3, seed=11 if backend == "local" else 12, backend=backend)
    summary = result.as_dict()
    assert result.kills == 3, summary
    assert result.wrong_tokens == 0 and result.wrong_stream == 0, summary
    assert result.lost == 0, summary
    assert result.unclear_errors == 0, summary
    assert result.completed + result.errored == result.requests, summary
    assert result.completed >= result.requests * 0.8, summary  # errors only for streams cut mid-way
    assert result.blocks_leaked == 0, summary
    assert len(result.recovery_s) == 3, summary
