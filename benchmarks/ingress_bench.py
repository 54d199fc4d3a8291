"""Ingress benchmark: what the HTTP path costs over the driver API on one-token completions.

    python -m benchmarks.ingress_bench                      # tiny preset, concurrency 1, 16, 64
    python -m benchmarks.ingress_bench --requests 400 --concurrency 1,16

The same request (a short text prompt, ``max_tokens`` 1, temperature 0, ``ignore_eos``) is sent at each
concurrency, first straight to a ``Cluster`` in this process (``Cluster.agenerate``, the driver
API: the baseline), then, with that cluster shut down, over HTTP to ``kvfleet serve`` on the
same preset (``benchmarks.support.serve_server.Server``, a fresh subprocess on a free loopback
port) with a keep-alive ``httpx`` client. Each side gets ``--warmup`` requests one at a time
first (not measured); each concurrency level sends ``--requests`` requests from that many
concurrent senders, and a request's latency is from the call to its whole answer.

Last stdout line, one JSON object: ``req_per_s``, ``p50_ms`` and ``p99_ms`` over HTTP, each
keyed by concurrency; ``driver_p50_ms``, ``driver_req_per_s`` (the same over the driver API)
and ``overhead_p50_ms`` (HTTP p50 minus driver p50), keyed the same; ``errors`` (HTTP answers
other than 200, and exceptions, on either side); ``requests``. With concurrency 1 among the
levels, ``breakdown_c1`` says where a request's time goes, in ms: the median of each TTFT hop
the driver's completions report (``route_ms``: the router call; ``queue_ms``, ``prefill_ms``,
``first_token_ms``: the worker call, ``actors.hops``), ``driver_latency_ms``; ``asgi_p50_ms``,
the same request through ``serving.api.build_api``'s app in the driver's process (httpx's ASGI
transport: the FastAPI edge, parsing, tokenizing and the JSON answer, no Ray Serve), and from
it ``edge_ms`` (ASGI p50 minus driver p50) and ``serve_hop_ms`` (HTTP p50 minus ASGI p50: what
serving over a socket adds; under ``kvfleet serve`` the ingress replica's own HTTP server, no
proxy: ``serving/http_server.py``).

Measured on this project's 2-core machine shared with other test runs (load average 8 to 16;
``--requests 200 --warmup 10``, tiny preset 1P+1D, two runs each, the old and the new code
interleaved). Behind Ray Serve's proxy (what ``serve run`` and the RayService still use): HTTP p50
59 / 109 ms at concurrency 1, 17.8 / 11.2 requests/s at 16; ``serve_hop_ms`` was 27 to 46 ms in
quieter runs. ``kvfleet serve`` with its ingress replica serving HTTP itself
(``serving/http_server.py``) and the driver path's per-request router calls cut (request ends
batched to the router, the predicted hit sent with the request): HTTP p50 36.0 / 39.6 ms at 1
(driver 34.8 / 37.8 ms, overhead 1.2 / 1.8 ms, ``serve_hop_ms`` 0.6 / 2.4), 27.5 / 22.7
requests/s at 16 (driver 57.5 / 68.1), no errors. What is left is the driver path itself
(``breakdown_c1``: route 6, queue 5, prefill 13 to 15, first token 5 ms): Ray calls (the router,
the worker's stream, the router's ack) and the engine step, each several times slower here than
on an idle machine. Open: at 16 and 64 HTTP falls behind the driver (p99 3 to 5 s against the
driver's 0.5 s). Ray's worker processes run at nice 15 while this process runs at nice 0, but
that is not the whole of it: with ``RAY_worker_niceness=0`` (one run, load average 4 to 5) HTTP
gave 36.5 ms p50 at 1 and 38.3 requests/s at 16, the driver 25.6 ms and 88.5 requests/s.

Where the driver path's time went (py-spy over the driver, the router and both workers, one-token
requests on the driver API, 2026-11-29, load average 2 to 6): at concurrency 1 the decode worker's
engine thread spent a quarter of its time in Ray calls to the router (the forced report of each
finished step, the load report before the forward), on the request's critical path; the worker's
stream added an item report to the call's reply; at 16 the decode worker's process (engine
thread, event loop, Ray's serializing threads) took most of the two cores while the prefill
worker idled: a prompt under ``router.decode_only_threshold_tokens`` (64) uncached tokens runs
whole on a decode worker, and the policy runs whole requests only on decode workers. Cut: a
finished request whose blocks were all reported already sends no report and waits for none
(``RouterLink.ack``), a one-token request is one plain call (``EngineWorker.complete``) instead of
a stream, and the routing calls a driver makes while one is in flight go as one
(``cluster.route_batch``). Driver API, one run each, before at load average 6, after at 7 to 8
(``/tmp`` profile harness, 300 to 1200 requests): p50 at 1 29.5 -> 21.1 ms (route 4.8 -> 4.4,
queue 4.3 -> 3.3, prefill 14.3 -> 9.7, first token 3.7 -> 2.9), 81.6 -> 145.9 requests/s at 16;
another run before gave 20.5 ms at 1, so the gain at 1 is within this machine's noise.
The engine's idle wait adds nothing (the engine thread blocks on its command queue, which a new
request wakes at once; only a KV transfer in flight is polled, every ``TRANSFER_WAIT_S``).
Left: a Ray call costs 2 to 5 ms here (the route and the worker call: about 8 ms of a request at
1) and an engine step of the tiny model 9 to 15 ms, so 8 ms p50 at 1 is out of reach on this
machine; a one-token request could run whole on an idle prefill worker (a policy change in
``engine/routing``). This benchmark (``--requests`` 200 for the first run before, then 150), the old and the new code
interleaved while other test runs loaded the machine (Ray's node timed out starting in several
other runs). Before, load average 19 to 28: HTTP p50 51.9 / 61.9 ms at 1, 19.7 / 21.3
requests/s at 16 (driver 40.1 / 79.4 ms, 58.2 / 37.9 requests/s). After: at load 20 to 28 HTTP
44.6 ms, 20.8 requests/s (driver 47.2 ms, 31.4/s); at load 11 to 12 HTTP 33.6 ms, 36.3
requests/s (driver 24.5 ms, 142.0/s; ``breakdown_c1`` route 5.0, queue 4.0, prefill 12.4, first
token 3.5 ms). No errors in any run. The HTTP path at 16 and 64 still falls far behind the
driver (the ingress replica is one more process at nice 15 on two cores).

What slowed the one-token path since the issue was filed (HTTP p50 17.6 ms at 1 then): the
token-bucket step of prefill and mixed steps (``engine/model/mixed_step.py``), which on the CPU
padded every such step to a multiple of 16 tokens with a pad chunk. This benchmark's 24-token
prompt hits 20 cached tokens, so each request's step computes 4 tokens: padded, it ran 16 tokens
and two chunks (1877 aten ops a step against 1499, torch profiler, in-process ``EngineCore``).
Paired on the driver API (150 requests, back to back, load average 5 to 8): the eager step
(``model.cuda_graphs=false``, the path before the token-bucket step) against the padded one gave
a prefill hop of 10.8 / 7.6 ms against 13.1 / 10.5, p50 at 1 of 23.1 / 18.6 ms against 27.3 /
21.6, 142 / 174 requests/s at 16 against 124 / 146. An uncaptured step now runs unpadded. And at
16 every request ran whole on decode-0 while prefill-0 idled: a one-token request now runs whole
on the cheapest worker of either role (``one_token``, ``engine/routing/policy.py``; the driver
sends ``max_tokens`` with the route). This benchmark, main then this change, back to back (load
average 5 to 7): HTTP p50 at 1 33.4 -> 30.7 ms, 43.6 -> 47.2 requests/s at 16; driver 33.0 ->
24.1 ms, 51.2 -> 104.5 requests/s; prefill hop 14.2 -> 11.7 ms; no errors.

The floor on this machine (why 8 ms at 1 and 300 requests/s at 16 are out of reach here): a bare
Ray async actor round trip from an asyncio driver is 2.7 ms p50, and one actor answers 602 calls/s
to 16 concurrent callers; a request makes two such calls (the router, the worker), so the driver's
Ray calls alone cap it near 300 requests/s with no engine, router or HTTP work on the same two
cores. The tiny model's engine step for a 4-token chunk is 4 to 5 ms at best in-process (1500
aten ops of a few microseconds each; 25 RMS norms at about 45 us each, ``F.rms_norm`` on the CPU
being a composite of eight ops), and 10 to 12 ms in the worker, which shares the cores with the
driver, the router and Ray's threads. Two round trips and one step: about 10 ms at best.

The report before each forward (``RouterLink.report_scheduled``): at concurrency 1 it is not
load-only. This benchmark's prompt recomputes its last block each time (a request's hit search
stops before its last token), and the block pool reports the fresh copy taking over the cached
entry, so the report carries one ``BlockStored``. Sent before the forward, the router has it
when the request finishes, and the request's ack costs nothing (``RouterLink.ack``). Deferred
past the forward, the finished request would wait for a report. What it costs the engine
thread is the Ray actor call: about 1 ms of CPU when calls are spaced as at concurrency 1 (0.4
ms back to back), a fifth of it Ray's cloudpickle of the events and load. Now they go as one
pickled argument (``pack_report``): 0.89 / 0.72 ms against 1.11 / 0.88 ms of caller CPU a call in
two microbenchmark runs. Tried and dropped: sending that report from a thread of its own while
the forward runs. Interleaved in one cluster (blocks of 25 requests switched through
``__ray_call__``), it gave the same p50 at 1 (22.05 against 22.1 ms, prefill hop 9.56 against
9.82) and 139 against 153 requests/s at 16: the call holds the GIL, and the two cores are
busy. Paired on the driver API, main then this change, back to back, 150 requests (load
average 3 to 6): prefill hop 11.9 -> 10.2 and 16.1 -> 12.9 ms; p50 at 1 26.7 -> 23.2 and
33.5 -> 28.1 ms; 118 -> 120 and 75 -> 107 requests/s at 16 (mean of two bursts). This
benchmark, ``--requests 150 --concurrency 1,16``, main then this change (load average 12 to 14):
HTTP p50 at 1 32.7 -> 31.6 ms, 46.0 -> 46.5 requests/s at 16; driver 28.7 -> 26.7 ms,
55.1 -> 72.6 requests/s; prefill hop 14.2 -> 12.3 ms; no errors.

Where the HTTP path's time goes at 16 (py-spy over the ingress replica under ``kvfleet serve``,
load average 10 to 20): kvfleet's own code is a few percent of the replica's samples (the
driver's Ray calls, FastAPI's middleware, parsing). The rest is Ray's and Serve's threads:
Ray's main loop, Serve's asyncio thread (its replica metrics), the user code's event loop and
Serve's router loop. Four threads share the GIL in a Ray worker process at nice 15, on two
cores that the workers and the router share too. Running Serve's user code on the actor's own
loop (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`` in ``kvfleet serve``'s environment) was
tried: the Ray node failed to start in all three runs with it set, and started in the run
without it just after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.support.serve_server import Server
from benchmarks.support.stats import percentile
from configs import load_config

log = logging.getLogger("ingress_bench")
PROMPT = "The capital of France is"


async def _level(call: Callable[[], Awaitable[bool]], concurrency: int, requests: int) -> dict[str, Any]:
    """``requests`` calls from ``concurrency`` senders: latencies, throughput, failures."""
    latencies: list[float] = []
    errors = 0
    remaining = requests

    async def sender() -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            try:
                ok = await call()
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, the run goes on
                log.warning("request failed: %s", exc)
                ok = False
            latencies.append(time.perf_counter() - started)
            errors += not ok

    started = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "req_per_s": round(requests / elapsed, 1),
        "p50_ms": round(percentile(latencies, 0.5) * 1e3, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1e3, 2),
        "errors": errors,
    }


async def _sweep(call: Callable[[], Awaitable[bool]], args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    for _ in range(args.warmup):
        await call()
    out = {}
    for concurrency in args.concurrency:
        out[concurrency] = await _level(call, concurrency, args.requests)
        log.info("concurrency %d: %s", concurrency, out[concurrency])
    return out


def driver_sweep(args: argparse.Namespace) -> tuple[dict[int, dict[str, Any]], dict[str, float]]:
    """The driver API's levels, then (on the same cluster, one request at a time) the median of
    each TTFT hop the completions report (``actors.hops``) and the p50 of the same request
    through ``serving.api.build_api``'s ASGI app in this process: the FastAPI edge without Ray
    Serve's proxy and replica."""
    from cluster.api import Cluster
    from serving.api import build_api

    with Cluster(load_config(args.config, args.set)) as cluster:
        hops: dict[str, list[float]] = {}
        totals: list[float] = []

        async def call() -> bool:
            result = await cluster.agenerate(PROMPT, {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True})
            for hop, seconds in result.hops.items():
                hops.setdefault(hop, []).append(seconds)
            totals.append(result.latency_s)
            return len(result.token_ids) == 1

        async def run() -> tuple[dict[int, dict[str, Any]], dict[str, float]]:
            levels = await _sweep(call, args)
            hops.clear()
            totals.clear()
            await _level(call, 1, args.requests)
            breakdown = {f"{hop}_ms": round(percentile(s, 0.5) * 1e3, 2) for hop, s in hops.items()}
            breakdown["driver_latency_ms"] = round(percentile(totals, 0.5) * 1e3, 2)
            transport = httpx.ASGITransport(app=build_api(cluster))
            async with httpx.AsyncClient(transport=transport, base_url="http://asgi", timeout=120.0) as client:
                model = (await client.get("/v1/models")).json()["data"][0]["id"]
                body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}

                async def asgi_call() -> bool:
                    return (await client.post("/v1/completions", json=body)).status_code == 200

                for _ in range(args.warmup):
                    await asgi_call()
                breakdown["asgi_p50_ms"] = (await _level(asgi_call, 1, args.requests))["p50_ms"]
            return levels, breakdown

        return asyncio.run(run())


def http_sweep(args: argparse.Namespace, kvfleet: str, logs: Path) -> dict[int, dict[str, Any]]:
    with Server(kvfleet, args.config, args.set, logs / "server.log") as server:

        async def run() -> dict[int, dict[str, Any]]:
            limits = httpx.Limits(
                max_connections=max(args.concurrency), max_keepalive_connections=max(args.concurrency)
            )
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120.0) as client:
                model = (await client.get("/v1/models")).json()["data"][0]["id"]
                body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}

                async def call() -> bool:
                    answer = await client.post("/v1/completions", json=body)
                    return answer.status_code == 200

                return await _sweep(call, args)

        return asyncio.run(run())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="tiny", help="preset or config file (default: tiny)")
    p.add_argument("--set", action="append", default=[], help="config override, as kvfleet serve --set")
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 16, 64])
    p.add_argument("--requests", type=int, default=200, help="requests per concurrency level (default 200)")
    p.add_argument("--warmup", type=int, default=10, help="unmeasured requests first, one at a time")
    p.add_argument("--kvfleet", default=None, help="kvfleet executable (default: next to this Python, then PATH)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    kvfleet = args.kvfleet or next(
        (c for c in (str(Path(sys.executable).parent / "kvfleet"), shutil.which("kvfleet")) if c and Path(c).is_file()),
        "kvfleet",
    )
    driver, breakdown = driver_sweep(args)
    with tempfile.TemporaryDirectory(prefix="ingress-bench-") as logs:
        http = http_sweep(args, kvfleet, Path(logs))
    levels = args.concurrency
    result = {
        "req_per_s": {c: http[c]["req_per_s"] for c in levels},
        "p50_ms": {c: http[c]["p50_ms"] for c in levels},
        "p99_ms": {c: http[c]["p99_ms"] for c in levels},
        "errors": sum(r["errors"] for r in (*http.values(), *driver.values())),
        "driver_p50_ms": {c: driver[c]["p50_ms"] for c in levels},
        "driver_req_per_s": {c: driver[c]["req_per_s"] for c in levels},
        "overhead_p50_ms": {c: round(http[c]["p50_ms"] - driver[c]["p50_ms"], 2) for c in levels},
        "requests": 2 * (args.warmup + args.requests * len(levels)),
    }
    if 1 in levels:  # concurrency 1, ms: the driver's TTFT hops, the ASGI edge, Serve's proxy and replica
        breakdown["edge_ms"] = round(breakdown["asgi_p50_ms"] - driver[1]["p50_ms"], 2)
        breakdown["serve_hop_ms"] = round(http[1]["p50_ms"] - breakdown["asgi_p50_ms"], 2)
        result["breakdown_c1"] = breakdown
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
