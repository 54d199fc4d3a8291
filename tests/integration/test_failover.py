"""Workers that fail: a dead actor, an engine that stopped, a process that froze. Each is taken out
of the router; requests that had streamed nothing run again elsewhere and give the single engine's
tokens, the others end with an error naming the worker; nothing hangs; the worker is replaced under
its id and rejoins the router; every block comes back. A request whose driver stopped renewing it is
aborted on its worker after its lease.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace
from typing import Any

import pytest
import ray

from engine.sampling_params import SamplingParams
from tests.integration.conftest import FAST_HEALTH, GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for

LONG = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
REPLACE_TIMEOUT_S = 180


def all_blocks_back(cluster: Any, expected_workers: set[str]) -> bool:
    stats = cluster.stats()
    workers = stats["workers"]
    return set(workers) == expected_workers and all(
        w["free_blocks"] == w["num_blocks"] and w["running"] == 0 and w["queued"] == 0 for w in workers.values()
    )


def replaced(cluster: Any, worker_id: str, count: int) -> bool:
    return cluster.replacements >= count and worker_id in cluster.workers and worker_id not in cluster.lost


async def run_concurrently(cluster: Any, prompts: list[list[int]], sampling: SamplingParams) -> list[Any]:
    """Every prompt at once; each result is a ClusterCompletion or the exception it raised."""
    runs = [cluster.agenerate(prompt, sampling) for prompt in prompts]
    return await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 240)


def check_outcomes(outcomes: list[Any], expected: list[list[int]], failed_worker: str) -> int:
    """Each request gave exactly the oracle's tokens or failed with an error naming the worker
    that failed (only after streaming, else it must have been retried); returns the failures."""
    errors = 0
    for outcome, tokens in zip(outcomes, expected, strict=True):
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, RuntimeError), repr(outcome)
            assert failed_worker in str(outcome) and "after streaming output" in str(outcome), str(outcome)
            errors += 1
        else:
            assert outcome.token_ids == tokens, (outcome.request_id, outcome.decode_worker)
    return errors


def test_dead_decode_worker_is_routed_around_and_replaced(ray_session):
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 2, *FAST_HEALTH)
    prompts = random_prompts(91, [6, 9, 12, 15, 18, 21, 90, 120])
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        ray.kill(cluster.workers["decode-1"], no_restart=True)
        results = cluster.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected
        wait_for(lambda: replaced(cluster, "decode-1", 1), REPLACE_TIMEOUT_S, "decode-1 replaced")
        stats = cluster.stats()
        assert set(stats["workers"]) == {"prefill-0", "decode-0", "decode-1"} and stats["unhealthy"] == {}
        assert set(stats["router"]["loads"]) == {"prefill-0", "decode-0", "decode-1"}
        assert set(cluster.health().values()) == {"ok"}
        again = cluster.generate(prompts * 2, GREEDY)
        assert [r.token_ids for r in again] == expected * 2
        assert "decode-1" in {r.decode_worker for r in again}  # the replacement serves
        wait_for(lambda: all_blocks_back(cluster, set(cluster.infos)), 30, "every block back")


def test_a_bad_request_fails_alone_and_the_worker_serves_on(ray_session):
    """A NaN temperature that got past every edge check reaches a worker: that request ends with
    an error saying why, the worker stays healthy and keeps giving exact tokens."""
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 1, *FAST_HEALTH)
    prompts = random_prompts(17, [8, 30, 52])
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        bad = SamplingParams.model_construct(**{**GREEDY.model_dump(), "temperature": float("nan")})
        stream = cluster.workers["decode-0"].generate.options(num_returns="streaming").remote("bad", [5, 6, 7], bad)
        chunks = [ray.get(ref, timeout=60) for ref in stream]
        assert [(c.finished, c.finish_reason, c.worker_failed) for c in chunks] == [(True, "error", False)]
        assert "sampling failed" in (chunks[0].error or "")
        assert [r.token_ids for r in cluster.generate(prompts, GREEDY)] == expected
        assert cluster.health() == {"prefill-0": "ok", "decode-0": "ok"}
        assert cluster.replacements == 0 and cluster.lost == {}
        wait_for(lambda: all_blocks_back(cluster, {"prefill-0", "decode-0"}), 30, "every block back")


@pytest.mark.parametrize("failure", ["engine_stopped", "frozen"])
def test_a_failed_worker_under_load_is_replaced_and_nothing_hangs(ray_session, failure: str):
    """decode-1 fails while requests stream from it: its engine stops (a request whose
    parameters break the scheduler, past validation), or its process freezes (SIGSTOP, so only
    the health check's timeout notices). Every request gives the oracle's tokens or (only if it
    had streamed) an error naming decode-1; none hangs; decode-1 is replaced and serves again."""
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 2, *FAST_HEALTH, "router.policy=round_robin")
    prompts = random_prompts(33, [7 + 5 * i for i in range(12)])
    expected = oracle_tokens(config, prompts, LONG)
    with Cluster(config) as cluster:
        victim = cluster.workers["decode-1"]
        pid = cluster.infos["decode-1"].pid

        async def fail_while_streaming() -> list[Any]:
            running = asyncio.ensure_future(run_concurrently(cluster, prompts, LONG))
            deadline = time.monotonic() + 120
            while (await victim.stats.remote())["running"] == 0:  # requests are on decode-1 now
                assert time.monotonic() < deadline, "no request reached decode-1"
                await asyncio.sleep(0.02)
            if failure == "frozen":
                os.kill(pid, signal.SIGSTOP)
            else:
                poison = SamplingParams.model_construct(**{**GREEDY.model_dump(), "stop_token_ids": None})
                victim.generate.options(num_returns="streaming").remote("poison", [5, 6, 7], poison)
            return await running

        try:
            outcomes = asyncio.run(fail_while_streaming())
            wait_for(lambda: "decode-1" in cluster.lost or cluster.replacements > 0, 60, "decode-1 found failed")
        finally:
            if failure == "frozen":
                _resume(pid)
        check_outcomes(outcomes, expected, "decode-1")
        wait_for(lambda: replaced(cluster, "decode-1", 1), REPLACE_TIMEOUT_S, "decode-1 replaced")
        assert cluster.workers["decode-1"] is not victim
        again = cluster.generate(prompts, LONG)
        assert [r.token_ids for r in again] == expected
        assert {r.decode_worker for r in again} == {"decode-0", "decode-1"}
        wait_for(lambda: all_blocks_back(cluster, set(cluster.infos)), 30, "every block back")


def test_a_request_whose_driver_is_gone_is_aborted_after_its_lease(ray_session):
    """Two identical endless streams on one worker; the test renews one of them the way a
    driver's health checks do and lets the other lapse, as when its driver or client is gone.
    The lapsed one is aborted once its lease runs out, while the renewed one runs on."""
    from cluster.api import Cluster

    lease_s = 4.0
    config = cluster_config(
        "tiny",
        1,
        1,
        "workers.health_check_interval_s=0.25",
        "workers.health_check_timeout_s=1.5",
        f"workers.request_lease_s={lease_s}",
        "model.max_model_len=4096",
    )
    endless = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(5, [40])[0]
    with Cluster(config) as cluster:
        worker = cluster.workers["decode-0"]

        async def scenario() -> tuple[Any, float, dict[str, Any]]:
            streams = {
                rid: worker.generate.options(num_returns="streaming").remote(rid, prompt, endless)
                for rid in ("kept", "lapsed")
            }

            async def renew() -> None:
                while True:
                    await worker.health.remote(["kept"])
                    await asyncio.sleep(0.3)

            async def last_chunk(stream: Any) -> Any:
                async for ref in stream:
                    chunk = await ref
                    if chunk.finished:
                        return chunk

            renewer = asyncio.ensure_future(renew())
            started = time.monotonic()
            try:
                end = await asyncio.wait_for(last_chunk(streams["lapsed"]), 120)
                elapsed = time.monotonic() - started
                stats = await worker.stats.remote()
            finally:
                renewer.cancel()
                await worker.abort.remote("kept")
            kept_end = await asyncio.wait_for(last_chunk(streams["kept"]), 60)
            assert kept_end.finish_reason == "abort"  # ended by the explicit abort above
            return end, elapsed, stats

        end, elapsed, stats = asyncio.run(scenario())
        assert end.finish_reason == "abort"
        assert elapsed >= lease_s - 1.0  # not before its lease ran out (it was granted at admission)
        assert stats["requests"] == 1, stats  # the renewed stream was still running then
        wait_for(lambda: all_blocks_back(cluster, {"prefill-0", "decode-0"}), 60, "every block back")
        assert cluster.stats()["workers"]["decode-0"]["requests_aborted"] >= 2


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def test_stats_and_health_report_a_broken_worker_instead_of_raising(ray_session):
    """With replacement off, a worker whose engine stopped stays out of the router; stats() and
    health() name it and why, and the cluster serves on with what is left."""
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 2, *FAST_HEALTH, "workers.replace_failed=false")
    prompts = random_prompts(44, [9, 21])
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        poison = SamplingParams.model_construct(**{**GREEDY.model_dump(), "stop_token_ids": None})
        stream = cluster.workers["decode-1"].generate.options(num_returns="streaming").remote("poison", [5, 6], poison)
        (chunk,) = [ray.get(ref, timeout=60) for ref in stream]
        assert chunk.worker_failed and "engine stopped" in (chunk.error or "")
        wait_for(lambda: "decode-1" in cluster.lost, 30, "decode-1 found broken")
        stats = cluster.stats()
        assert set(stats["workers"]) == {"prefill-0", "decode-0"}
        assert "decode-1" in stats["unhealthy"] and "engine stopped" in stats["unhealthy"]["decode-1"]
        assert set(stats["router"]["loads"]) == {"prefill-0", "decode-0"}
        health = cluster.health()
        assert health["decode-0"] == "ok" and "engine stopped" in health["decode-1"]
        assert [r.token_ids for r in cluster.generate(prompts, GREEDY)] == expected
        assert cluster.replacements == 0


def test_a_worker_another_driver_removed_first_is_still_replaced(ray_session):
    """An attached driver (a Serve ingress replica) may notice a dead worker and take it out of
    the router before the owner does; the owner must still find it dead and replace it, and the
    attached driver adopt the replacement. (CI once saw the owner re-register the dead actor on
    every round while the ingress removed it again, so it was never replaced.)"""
    from cluster.api import Cluster

    config = cluster_config(
        "tiny",
        1,
        2,
        "workers.health_check_interval_s=2",
        "workers.health_check_timeout_s=3",
        "workers.request_lease_s=10",
    )
    fast = config.model_copy(update={"workers": config.workers.model_copy(update={"health_check_interval_s": 0.2})})
    prompts = random_prompts(55, [11, 23, 37])
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        attached = Cluster.attach(replace(cluster.handles(), config=fast))  # notices failures first
        try:
            victim = cluster.workers["decode-1"]
            ray.kill(victim, no_restart=True)
            wait_for(lambda: "decode-1" in attached.lost, 30, "the attached driver to notice")
            wait_for(lambda: replaced(cluster, "decode-1", 1), REPLACE_TIMEOUT_S, "decode-1 replaced")
            registered = ray.get(cluster.router.worker_handles.remote(), timeout=30)
            assert registered["decode-1"]._actor_id != victim._actor_id
            wait_for(
                lambda: replaced(attached, "decode-1", 0) and attached.workers["decode-1"] is not victim,
                30,
                "the attached driver to adopt the replacement",
            )
            assert set(cluster.stats()["router"]["loads"]) == {"prefill-0", "decode-0", "decode-1"}
            assert [r.token_ids for r in attached.generate(prompts * 2, GREEDY)] == expected * 2
        finally:
            attached.shutdown()
