"""What an operator relies on: the queue bound answers 429 with Retry-After and loses nothing,
/metrics is Prometheus text whose counters move, pins and stats over HTTP, and /health turns 503
when a worker actor dies (the last test: it breaks the ``small`` application)."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import SMALL_QUEUE_BOUND, Server, all_blocks_free, wait_for


def metric_values(server: Server) -> dict[str, float]:
    response = httpx.get(f"{server.base}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def test_metrics_parse_and_their_counters_move(server: Server) -> None:
    before = metric_values(server)
    result = server.openai().completions.create(
        model=server.model, prompt="count me " * 6, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.usage.completion_tokens == 5
    after = metric_values(server)
    ok = "kvfleet_http_requests_total|endpoint=/v1/completions|status=200"
    assert after[ok] == before.get(ok, 0.0) + 1
    assert after["kvfleet_generation_tokens_total"] == before.get("kvfleet_generation_tokens_total", 0.0) + 5
    assert after["kvfleet_prompt_tokens_total"] >= before.get("kvfleet_prompt_tokens_total", 0.0) + 54
    assert (
        after["kvfleet_time_to_first_token_seconds_count"]
        == before.get("kvfleet_time_to_first_token_seconds_count", 0.0) + 1
    )
    assert (
        after["kvfleet_inter_token_latency_seconds_count"]
        >= before.get("kvfleet_inter_token_latency_seconds_count", 0.0) + 1
    )
    e2e, ttft = "kvfleet_e2e_request_latency_seconds", "kvfleet_time_to_first_token_seconds"
    assert after[f"{e2e}_count"] == before.get(f"{e2e}_count", 0.0) + 1
    e2e_s = after[f"{e2e}_sum"] - before.get(f"{e2e}_sum", 0.0)
    assert after[f"{ttft}_sum"] - before.get(f"{ttft}_sum", 0.0) <= e2e_s + 1e-9 < 60  # arrival to the last token
    assert after[f"{e2e}_bucket|le=+Inf"] == after[f"{e2e}_count"]
    for gauge in (
        "kvfleet_queue_depth",
        "kvfleet_running_requests",
        "kvfleet_prefix_cache_hit_rate",
        "kvfleet_free_blocks",
        "kvfleet_pinned_blocks",
        "kvfleet_kv_transfer_bytes",
        "kvfleet_http_requests_in_flight",
    ):
        assert gauge in after, gauge
    assert after["kvfleet_kv_transfer_bytes"] > 0  # the main app splits P/D: KV moved


def test_a_pd_request_moves_the_transfer_series(server: Server) -> None:
    """The decode worker's reads reach /metrics: a prompt no worker has cached is split P/D, its
    KV read counts one transfer more, with its seconds."""
    before = metric_values(server)
    prompt = " ".join(f"fresh{i}" for i in range(40))  # unseen: the router splits it off to prefill
    result = server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    assert result.usage.completion_tokens >= 1
    after = metric_values(server)
    assert after["kvfleet_kv_transfers_total"] >= before.get("kvfleet_kv_transfers_total", 0.0) + 1
    assert after["kvfleet_kv_transfer_seconds_total"] > before.get("kvfleet_kv_transfer_seconds_total", 0.0)
    assert after["kvfleet_kv_transfer_bytes"] > before.get("kvfleet_kv_transfer_bytes", 0.0)


def test_pins_and_stats_over_http(server: Server) -> None:
    created = server.post("/v1/pins", json={"prefix": "You are a helpful assistant. " * 3, "replicas": 1, "ttl": 300})
    assert created.status_code == 201, created.text
    pin = created.json()
    assert pin["object"] == "pin" and pin["replicas"] == 1 and pin["num_tokens"] > 0 and pin["tier"] == "device"
    wait_for(
        lambda: any(p["id"] == pin["id"] and p["active"] for p in server.get("/v1/pins").json()["data"]),
        30,
        "the pin to become active",
    )
    [listed] = [p for p in server.get("/v1/pins").json()["data"] if p["id"] == pin["id"]]
    assert listed["holder_tiers"] == {worker: "device" for worker in listed["active"]}
    assert server.totals()["explicitly_pinned_blocks"] > 0
    stats = server.get("/v1/stats").json()
    assert set(stats) == {"workers", "unhealthy", "totals", "router"} and stats["unhealthy"] == {}
    assert set(stats["workers"]) == {"prefill-0", "decode-0"}
    token_pin = server.post("/v1/pins", json={"prefix": list(range(40, 80))})
    assert token_pin.status_code == 201
    for pin_id in (pin["id"], token_pin.json()["id"]):
        deleted = httpx.delete(f"{server.base}/v1/pins/{pin_id}", headers=server.headers(), timeout=30)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert all(p["id"] not in (pin["id"], token_pin.json()["id"]) for p in server.get("/v1/pins").json()["data"])
    try:
        wait_for(lambda: server.totals()["explicitly_pinned_blocks"] == 0, 10, "pinned blocks released")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; stats: {server.get('/v1/stats').json()}") from None


def test_the_queue_bound_answers_429_and_loses_nothing(small_server: Server) -> None:
    server = small_server
    wait_for(all_blocks_free(server), 10, "an idle small cluster")
    prompts = [f"request number {i} " * 4 for i in range(8)]
    body = {"model": server.model, "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(
                await asyncio.gather(
                    *(client.post(f"{server.base}/v1/completions", json={**body, "prompt": p}) for p in prompts)
                )
            )

    responses = asyncio.run(send_all())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1, f"a bound of {SMALL_QUEUE_BOUND} let all {len(prompts)} in: {codes}"
    assert codes.count(200) >= 1
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_error"
        else:
            assert response.json()["usage"]["completion_tokens"] == 48
    # nothing is lost: every refused request succeeds when retried, and every block comes back
    for prompt, response in zip(prompts, responses, strict=True):
        if response.status_code == 429:
            retried = httpx.post(f"{server.base}/v1/completions", json={**body, "prompt": prompt}, timeout=120)
            assert retried.status_code == 200 and retried.json()["usage"]["completion_tokens"] == 48
    wait_for(all_blocks_free(server), 10, "every block back after the burst")


def test_health_turns_503_naming_a_killed_worker(small_server: Server) -> None:
    import ray

    server = small_server
    assert httpx.get(f"{server.base}/health", timeout=30).status_code == 200
    handles = server.controller_handles()
    ray.kill(handles.workers["decode-0"], no_restart=True)
    deadline = time.monotonic() + 30
    response = httpx.get(f"{server.base}/health", timeout=30)
    while response.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        response = httpx.get(f"{server.base}/health", timeout=30)
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["status"] == "unhealthy"
    assert body["workers"]["prefill-0"] == "ok"
    assert body["workers"]["decode-0"] != "ok"
    assert "decode-0" in body["error"]["message"]
    # the controller replaces it; the ingress adopts the replacement, and /health is 200 again
    deadline = time.monotonic() + 180
    while response.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        response = httpx.get(f"{server.base}/health", timeout=30)
    assert response.status_code == 200, response.text
    reply = httpx.post(
        f"{server.base}/v1/completions",
        timeout=120,
        json={"model": server.model, "prompt": "after", "max_tokens": 4, "temperature": 0},
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
