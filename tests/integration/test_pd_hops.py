"""The P/D path without needless hops (docs/architecture.md, One request), and its TTFT breakdown.

Engine level (no Ray): a decode engine told of a request before its prefill ends reserves the
prompt's blocks at once, frees them at once on an abort (and a handle that arrives afterwards
still lets its owner free at once), and a warmed peer's first read opens no connection.
Cluster level: the decode worker holds the reserved blocks while the prefill worker is frozen
mid-prefill (so the allocation provably precedes the prefill's end), exact tokens against a
single engine on tiny and tiny-hybrid with every request split, predicted == actual hits with
no synchronous router call on any engine thread, the hops summing to the driver's TTFT, aborts
and a lost prefill worker leaving no reserved block behind, and NIXL warm-up at start.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Self

import pytest

from configs import load_config
from engine.sampling_params import SamplingParams
from tests.integration.conftest import (
    FAST_HEALTH,
    GREEDY,
    cluster_config,
    oracle_tokens,
    random_prompts,
    wait_for,
)

PD_HOPS = ("route", "prefill_queue", "prefill", "handle", "transfer", "first_token")
ALL_SPLIT = "router.decode_only_threshold_tokens=0"


# -- engine level ----------------------------------------------------------------------------------
def _engines(preset: str, *overrides: str) -> tuple[Any, Any, Any]:
    from engine.core import EngineCore

    config = load_config(preset, ["transfer.backend=local", *overrides])
    return config, EngineCore(config, name="p", kv_role="prefill"), EngineCore(config, name="d", kv_role="decode")


def _prefill(engine: Any, request_id: str, prompt: list[int]) -> Any:
    engine.add_request(request_id, prompt, GREEDY, prefill_only=True)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                assert out.kv_handle is not None, out
                return out.kv_handle
    raise AssertionError("prefill did not finish")


def _run(engine: Any, request_id: str, until: float = 60) -> list[int]:
    tokens: list[int] = []
    end = time.monotonic() + until
    while time.monotonic() < end:
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                if out.finished:
                    assert out.finish_reason == "length", out
                    return tokens
    raise AssertionError("request did not finish")


def _free(engine: Any) -> int:
    return int(engine.worker_view.stats()["free_blocks"])


def _released(prefill: Any) -> bool:
    prefill.step()
    return not prefill.scheduler.held


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_an_announced_request_reserves_at_once_and_reads_when_its_handle_comes(preset):
    config, prefill, decode = _engines(preset)
    prompt = random_prompts(3, [150])[0]
    (expected,) = oracle_tokens(config, [prompt])
    try:
        before = _free(decode)
        decode.expect_remote_prefill("r", prompt, GREEDY, prefill.agent_info)
        assert decode.worker_view.is_reserved("r") and _free(decode) < before, (
            "blocks reserved before any handle exists"
        )
        assert decode.worker_view.transfer_stats.warm_ups == 1
        handle = _prefill(prefill, "r", prompt)  # the prefill runs after the reservation
        assert decode.provide_handle("r", handle) is None
        assert _run(decode, "r") == expected
        stats = decode.worker_view.transfer_stats
        assert stats.reads == 1 and stats.failures == 0 and stats.cold_reads == 0
        wait_for(lambda: _released(prefill), 10, "the owner to free on the reader's notification")
        assert prefill.worker_view.transfer_stats.released_by_notification == 1
    finally:
        prefill.close()
        decode.close()


def test_an_aborted_announcement_frees_at_once_and_its_late_handle_still_frees_the_owner():
    _, prefill, decode = _engines("tiny")
    prompt = random_prompts(4, [120])[0]
    try:
        before = _free(decode)
        decode.expect_remote_prefill("r", prompt, GREEDY)
        assert _free(decode) < before
        assert decode.abort("r") and _free(decode) == before and not decode.worker_view.expected
        handle = _prefill(prefill, "r", prompt)
        assert decode.provide_handle("r", handle) is None  # nobody expects it: notification only
        for _ in range(20):
            decode.step()
        wait_for(lambda: _released(prefill), 10, "the owner to free at the notification, not the timeout")
        assert prefill.worker_view.transfer_stats.released_by_notification == 1
        assert decode.worker_view.transfer_stats.reads == 0 and _free(decode) == before
        decode.coordinator.check_invariants()
    finally:
        prefill.close()
        decode.close()


def test_an_announcement_without_room_waits_for_its_handle_and_stays_exact():
    """A pool too small to reserve at announcement: nothing is computed early, the handle
    takes the usual path, the tokens stay exact."""
    config, prefill, decode = _engines("tiny", "kv_cache.num_blocks=70", "kv_cache.pinning.budget_blocks=16")
    prompts = random_prompts(5, [150, 150])
    expected = oracle_tokens(config, prompts)
    try:
        decode.expect_remote_prefill("a", prompts[0], GREEDY)
        decode.expect_remote_prefill("b", prompts[1], GREEDY)
        assert decode.worker_view.is_reserved("a") and not decode.worker_view.is_reserved("b")
        assert not decode.has_compute_work, "an unreserved announcement computes nothing yet"
        handles = {rid: _prefill(prefill, rid, p) for rid, p in zip("ab", prompts, strict=False)}
        decode.provide_handle("a", handles["a"])
        assert _run(decode, "a") == expected[0]
        decode.provide_handle("b", handles["b"])
        assert _run(decode, "b") == expected[1]
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_a_warmed_peer_first_read_opens_no_connection(backend):
    if backend == "nixl":
        pytest.importorskip("nixl")
    from engine.core import EngineCore

    config = load_config("tiny", [f"transfer.backend={backend}"])
    prefill = EngineCore(config, name="p", kv_role="prefill")
    cold = EngineCore(config, name="cold", kv_role="decode")
    warm = EngineCore(config, name="warm", kv_role="decode")
    prompts = random_prompts(6, [90, 90])
    try:
        assert warm.warm_peer(prefill.agent_info) and not warm.warm_peer(prefill.agent_info)
        for rid, engine, prompt in (("c", cold, prompts[0]), ("w", warm, prompts[1])):
            engine.add_request(rid, prompt, GREEDY, kv_handle=_prefill(prefill, rid, prompt))
            _run(engine, rid)
        assert (cold.worker_view.transfer_stats.cold_reads, cold.worker_view.transfer_stats.warm_ups) == (1, 0)
        assert (warm.worker_view.transfer_stats.cold_reads, warm.worker_view.transfer_stats.warm_ups) == (0, 1)
        assert warm.worker_view.transfer_stats.failures == cold.worker_view.transfer_stats.failures == 0
    finally:
        for engine in (prefill, cold, warm):
            engine.close()


# -- cluster level ---------------------------------------------------------------------------------
def _worker_stats(cluster: Any, worker_id: str) -> dict[str, Any]:
    """One worker's stats, asked of it alone (``cluster.stats`` would wait on a frozen one)."""
    import ray

    return dict(ray.get(cluster.workers[worker_id].stats.remote(), timeout=30))


def _all_free(cluster: Any) -> bool:
    workers = [_worker_stats(cluster, worker_id) for worker_id in cluster.workers]
    return all(w["free_blocks"] == w["num_blocks"] and w["expecting_handles"] == 0 for w in workers)


class _Frozen:
    """SIGSTOP a worker process for the duration of a ``with`` block (SIGCONT on the way out)."""

    def __init__(self, pid: int):
        self.pid = pid

    def __enter__(self) -> Self:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_the_decode_worker_reserves_while_the_prefill_runs(ray_session):
    """The prefill worker is frozen before the request arrives: its prefill cannot have ended,
    yet the decode worker already holds the prompt's blocks. Then the breakdown shows the
    reservation ready before the handle, and the critical-path hops sum to the TTFT."""
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 1, ALL_SPLIT)
    prompt = random_prompts(7, [160])[0]
    (expected,) = oracle_tokens(config, [prompt])
    with Cluster(config) as cluster:
        num_blocks = _worker_stats(cluster, "decode-0")["num_blocks"]
        with _Frozen(cluster.infos["prefill-0"].pid):
            thread, box = _in_thread(lambda: cluster.generate([prompt], GREEDY)[0])
            wait_for(lambda: _worker_stats(cluster, "decode-0")["expecting_handles"] == 1, 20, "the announcement")
            decode = _worker_stats(cluster, "decode-0")
            assert decode["free_blocks"] < num_blocks, "the prompt's blocks are reserved during the prefill"
            time.sleep(0.3)
        thread.join(60)
        result = box["result"]
        assert result.token_ids == expected and result.disaggregated
        hops = result.hops
        assert set(PD_HOPS) <= set(hops) and all(v >= 0 for k, v in hops.items() if k != "decode_lead")
        assert hops["decode_lead"] > 0.3, hops  # reserved before the handle came (P was frozen >= 0.3 s)
        # the frozen prefill worker answered its call late: the call's legs (split between the
        # queue and the handle hop; no clock of the frozen process saw the wait) hold the freeze
        assert hops["prefill_queue"] + hops["handle"] > 0.3, hops
        assert sum(hops[k] for k in PD_HOPS) == pytest.approx(result.ttft_s, abs=2e-3)
        wait_for(lambda: _all_free(cluster), 15, "every block back")


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_exact_tokens_and_predicted_hits_with_every_request_split(ray_session, preset):
    """Every request through the prefill worker, twice (the second round hits): greedy tokens
    equal a single engine's, and the router's predicted hit equals the worker's actual hit
    for each, although no engine thread waits for the router any more."""
    from cluster.api import Cluster

    config = cluster_config(preset, 1, 1, ALL_SPLIT, "router.work_imbalance_ratio=0")
    base = random_prompts(8, [140])[0]
    prompts = [*random_prompts(9, [40, 97, 180]), base, base[:100] + random_prompts(10, [50])[0]]
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        for round_ in range(2):
            results = [cluster.generate([p], GREEDY)[0] for p in prompts]  # one at a time: routed after the last
            assert [r.token_ids for r in results] == expected, round_
            assert all(r.disaggregated for r in results)
            for r in results:
                assert r.predicted_hit == r.cached_tokens, (round_, r.route_reason, r.predicted_hit, r.cached_tokens)
                assert set(PD_HOPS) <= set(r.hops)
                assert sum(r.hops[k] for k in PD_HOPS) == pytest.approx(r.ttft_s, abs=2e-3)
        assert max(r.cached_tokens for r in results) >= 64, "the second round hits"
        whole = cluster.generate([[5]], GREEDY)[0]  # one token: runs whole on the decode worker
        assert not whole.disaggregated and {"route", "queue", "prefill", "first_token"} <= set(whole.hops)
        wait_for(lambda: _all_free(cluster), 15, "every block back")


def test_an_abort_during_the_prefill_frees_the_decode_reservation_at_once(ray_session):
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 1, ALL_SPLIT)
    prompt = random_prompts(11, [160])[0]
    with Cluster(config) as cluster:
        num_blocks = _worker_stats(cluster, "decode-0")["num_blocks"]
        with _Frozen(cluster.infos["prefill-0"].pid):
            thread, box = _in_thread(lambda: cluster.generate([prompt], GREEDY, request_ids=["victim"])[0])
            wait_for(lambda: _worker_stats(cluster, "decode-0")["expecting_handles"] == 1, 20, "the announcement")
            # the abort reaches the decode worker now, the frozen prefill worker when it wakes
            aborter, aborted = _in_thread(lambda: cluster.abort("victim"))

            def released() -> bool:
                decode = _worker_stats(cluster, "decode-0")
                return decode["expecting_handles"] == 0 and decode["free_blocks"] == num_blocks

            wait_for(released, 10, "the decode worker to free its reservation while the prefill is frozen")
        aborter.join(60)
        assert aborted.get("result") is True, aborted
        thread.join(60)
        assert box["result"].finish_reason == "abort"
        wait_for(lambda: _all_free(cluster), 15, "every block back")
        assert cluster.generate([prompt], GREEDY)[0].token_ids == oracle_tokens(config, [prompt])[0]


def test_a_prefill_worker_lost_mid_prefill_leaves_no_reservation(ray_session):
    """The prefill worker dies while the decode worker holds the reservation: the request runs
    again (exact tokens) and the decode worker's reserved blocks all come back."""
    import ray

    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 1, ALL_SPLIT, *FAST_HEALTH)
    prompt = random_prompts(12, [160])[0]
    (expected,) = oracle_tokens(config, [prompt])
    with Cluster(config) as cluster:
        with _Frozen(cluster.infos["prefill-0"].pid):
            thread, box = _in_thread(lambda: cluster.generate([prompt], GREEDY)[0])
            wait_for(lambda: _worker_stats(cluster, "decode-0")["expecting_handles"] == 1, 20, "the announcement")
            ray.kill(cluster.workers["prefill-0"], no_restart=True)
        thread.join(90)
        assert "error" not in box, box.get("error")
        assert box["result"].token_ids == expected
        wait_for(lambda: cluster.replacements >= 1, 60, "the prefill worker's replacement")
        wait_for(lambda: _all_free(cluster), 30, "every block back")


def test_decode_workers_warm_their_nixl_connections_at_start(ray_session):
    pytest.importorskip("nixl")
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 1, ALL_SPLIT, "transfer.backend=nixl")
    prompts = random_prompts(13, [60, 120])
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        assert _worker_stats(cluster, "decode-0")["transfer"]["warm_ups"] == 1, "warmed before any request"
        results = [cluster.generate([p], GREEDY)[0] for p in prompts]
        assert [r.token_ids for r in results] == expected
        transfer = _worker_stats(cluster, "decode-0")["transfer"]
        assert transfer["reads"] == 2 and transfer["cold_reads"] == 0 and transfer["failures"] == 0
        assert all("transfer" in r.hops for r in results)


def test_hops_of_a_sampling_stop_at_the_first_token(ray_session):
    """max_tokens=1: the first token is also the last chunk, which carries the hops."""
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 1, ALL_SPLIT)
    prompt = random_prompts(14, [90])[0]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with Cluster(config) as cluster:
        result = cluster.generate([prompt], one)[0]
        assert len(result.token_ids) == 1 and set(PD_HOPS) <= set(result.hops)


def test_pd_overhead_measurement_reports_the_ratio_and_every_hop(ray_session):
    from benchmarks.pd_overhead import OverheadWorkload, measure_pd_overhead

    config = cluster_config("tiny", 1, 1)
    out = measure_pd_overhead(config, OverheadWorkload(num_requests=4, prompt_tokens=90, warmup=1))
    assert out["requests"] == out["split"] == 4
    assert out["pd_ttft_overhead_ratio"] == pytest.approx(out["pd_ttft_p50_s"] / out["single_ttft_p50_s"], rel=0.01)
    assert set(PD_HOPS) <= set(out["hops"]) and all(out["hops"][h]["n"] == 4 for h in PD_HOPS)
    assert {"route", "queue", "prefill", "first_token"} <= set(out["single_hops"])
