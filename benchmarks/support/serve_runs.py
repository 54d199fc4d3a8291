"""The runs of ``benchmarks/serve_bench.py``: one policy at one rate, and the HTTP layer's own cost.

Owns ``Bench`` (what every run shares; ``run_policy``: one policy at one rate under guidellm on a
fresh, identically warmed server; ``http_overhead``: HTTP TTFT against the driver API's, side by
side) and the two TTFT probes it compares (``http_first_text_s``, ``first_text_s``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.support.serve_http import cluster_stats, served_model, stream_completion
from benchmarks.support.serve_loadgen import run_tool
from benchmarks.support.serve_results import ratio, summarize_report
from benchmarks.support.serve_server import Server
from benchmarks.support.serve_workload import Workload
from benchmarks.support.stats import percentile

log = logging.getLogger("serve_bench")


@dataclass
class Bench:
    """What every run shares: the server command, config and overrides, prompts, the tool."""

    kvfleet: str
    config: str
    overrides: list[str]
    tool: str
    tokenizer_dir: Path
    workload: Workload
    prompts: list[str]
    warmups: list[str]
    out_dir: Path
    sent: int = 0
    lost: int = 0

    def server(self, policy: str, name: str) -> Server:
        overrides = [*self.overrides, f"router.policy={policy}"]
        return Server(self.kvfleet, self.config, overrides, self.out_dir / f"{name}.server.log")

    def warm(self, server: Server, model: str) -> None:
        for prompt in self.warmups:
            self.sent += 1
            stream_completion(server.url, model, prompt, self.workload.max_tokens)

    def run_policy(self, policy: str, rate: float) -> dict[str, Any]:
        """One policy at one rate on a fresh, identically warmed server."""
        name = f"{policy}@{rate:g}"
        run_dir = self.out_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        with self.server(policy, name) as server:
            model = served_model(server.url)
            self.warm(server, model)
            log.info("%s: %d requests at %g req/s", name, len(self.prompts), rate)
            report = run_tool(
                self.tool,
                server.url,
                model,
                self.out_dir / "prompts.jsonl",
                self.tokenizer_dir,
                rate,
                len(self.prompts),
                run_dir,
            )
            workers, routes = cluster_stats(server.url)
        result = {
            "policy": policy,
            "rate_rps": rate,
            **summarize_report(report, len(self.prompts)),
            "server_start_s": round(server.start_s, 1),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "workers": workers,
            "route_outcomes": routes,
        }
        self.sent += result["sent"]
        self.lost += result["lost"]
        log.info(
            "%s: TTFT p50 %.3f s p90 %.3f s, hit rate %s, %d lost",
            name,
            result["ttft_p50_s"],
            result["ttft_p90_s"],
            result["hit_rate"],
            result["lost"],
        )
        return result

    def http_overhead(self, count: int) -> dict[str, Any]:
        """TTFT p50 through HTTP over TTFT p50 through the driver API, one request at a time
        (kvfleet policy): a fresh server and a fresh driver cluster side by side, warmed alike,
        each prompt sent to one then the other, so a change in the machine's load weighs on both."""
        from cluster.api import Cluster
        from configs import load_config
        from engine.sampling_params import SamplingParams

        config = load_config(self.config, [*self.overrides, "router.policy=kvfleet"])
        sampling = SamplingParams(max_tokens=self.workload.max_tokens, temperature=0.0, ignore_eos=True)
        driver: list[float] = []
        http_ttfts: list[float] = []
        with self.server("kvfleet", "overhead") as server, Cluster(config) as cluster:
            model = served_model(server.url)
            self.warm(server, model)

            async def timed(side: str, call: Coroutine[Any, Any, float], out: list[float]) -> None:
                self.sent += 1
                try:
                    out.append(await call)
                except Exception as exc:  # noqa: BLE001 - a failed request is counted and logged, the run goes on
                    self.lost += 1
                    log.warning("%s request failed: %s", side, exc)

            async def drive() -> None:
                for prompt in self.warmups:
                    self.sent += 1
                    await cluster.agenerate(prompt, sampling)
                for prompt in self.prompts[:count]:
                    await timed("driver", first_text_s(cluster, prompt, sampling), driver)
                    await timed(
                        "HTTP", http_first_text_s(server.url, model, prompt, self.workload.max_tokens), http_ttfts
                    )

            asyncio.run(drive())
        driver_p50, http_p50 = percentile(driver, 0.5), percentile(http_ttfts, 0.5)
        log.info("HTTP overhead: TTFT p50 driver %.4f s, HTTP %.4f s", driver_p50, http_p50)
        return {
            "requests": count,
            "driver_ttft_p50_s": round(driver_p50, 4),
            "http_ttft_p50_s": round(http_p50, 4),
            "driver_ttft_p90_s": round(percentile(driver, 0.9), 4),
            "http_ttft_p90_s": round(percentile(http_ttfts, 0.9), 4),
            "http_ttft_overhead_ratio": ratio(http_p50, driver_p50),
        }


async def http_first_text_s(url: str, model: str, prompt: str, max_tokens: int) -> float:
    """``stream_completion``'s TTFT, from a thread (the caller's event loop keeps running)."""
    return float((await asyncio.to_thread(stream_completion, url, model, prompt, max_tokens))["ttft_s"])


async def first_text_s(cluster: Any, prompt: str, sampling: Any) -> float:
    """Seconds from the driver call to its first text delta, timed by the caller as the HTTP
    client times its first chunk (tokenizing included on both sides); the stream runs to its end."""
    start = time.perf_counter()
    ttft = None
    async for delta in cluster.stream(prompt, sampling):
        if delta and ttft is None:
            ttft = time.perf_counter() - start
    return ttft if ttft is not None else time.perf_counter() - start
