"""Serving benchmark: the OpenAI-compatible HTTP API (``kvfleet serve``) under a real load
generator (guidellm), on a shared-prefix workload, for the router policies kvfleet, prefix_tree
and round_robin; plus the HTTP layer's own cost against the driver API.

    python benchmarks/serve_bench.py                           # local preset (Gemma-3-270M), 2P+2D
    python benchmarks/serve_bench.py --rates 0.5,1.0 --policies kvfleet,round_robin

The load generator is guidellm, pinned in pyproject.toml's ``bench`` extra. It would downgrade
a package the project's environment has (click 8.5 -> 8.4; ray, torch, transformers and pydantic
stay as they are), so install it in a venv of its own, anywhere outside the repository ($LG
below), and name its executable (torch first, so that pip keeps the CPU wheel, not CUDA's):

    python3 -m venv $LG && $LG/bin/pip install torch==2.13.0 && $LG/bin/pip install guidellm==0.8.1
    KVFLEET_GUIDELLM=$LG/bin/guidellm python benchmarks/serve_bench.py

(``--guidellm PATH`` does the same; without either, ``guidellm`` is looked up next to this
Python, then on PATH.) The server is ``kvfleet serve`` from this Python's environment
(``--kvfleet PATH`` to use another).

Workload (the idea of ``cluster/bench.py`` in text, since a load generator sends text):
``--num-prefixes`` documents of about ``--prefix-tokens`` tokens of pseudo-words, each asked
``--requests-per-prefix`` questions of about ``--suffix-tokens`` tokens, shuffled once; every
policy and every rate gets the same prompts in the same order, ``--max-tokens`` out with
``ignore_eos`` at temperature 0. Each worker's pool is sized as ``kvfleet bench`` sizes it:
``--cache-fraction`` of the prefix set plus room for ``--in-flight`` requests, so a router that
spreads every prefix over every worker evicts. guidellm sends the requests at a constant rate
(``--rates``, requests/s); the ratios in the summary are taken at the highest rate.

Every (policy, rate) run gets a fresh server (a fresh cluster, caches empty) on a free loopback
port, warmed up identically before guidellm starts (one request at a time: ``--warmup`` short
unrelated prompts, then each prefix once with a warm-up question of its own, placed by the
policy under test; ``--no-warm-prefixes`` leaves the first sights in the measured run, where at
80 requests they and the requests queued behind them fill the p90 of every policy alike), and
stopped with SIGINT (the server drains) afterwards.

HTTP overhead: the first ``--overhead-requests`` prompts sent one at a time (kvfleet policy,
same config) to a fresh server and a fresh driver cluster running side by side, each prompt
through the driver API (``Cluster.stream``, timed by the caller to its first text delta) and
then through HTTP with a minimal streaming client (timed to the first chunk with text), so a
change in the machine's load weighs on both; ``http_ttft_overhead_ratio`` is HTTP TTFT p50 over
driver TTFT p50. Both sides time from the call, tokenizing included.

Last stdout line, one JSON object: ``tool``, ``tool_version``, ``p90_ttft_ratio_vs_round_robin``,
``p90_ttft_ratio_vs_prefix_tree`` (kvfleet's p90 TTFT over the baseline's at ``ratio_rate_rps``),
``http_ttft_overhead_ratio``, ``requests`` (every request sent: warmups, guidellm's, the overhead
passes), ``lost`` (those that did not complete), and per-policy per-rate details under ``runs``.
One JSON line per (policy, rate) run is printed before it. Progress goes to stderr (logging).

Measured on this project's machines (2 cores shared with other agents' test runs, 1-minute load
average 2.2-8.3 during the run; Gemma-3-270M fp32, 2P+2D, defaults: 5 prefixes x 16 requests of
273-277 tokens, 8 out, 364 blocks per worker, 0.5 and 1.0 req/s), 19.2 minutes:

    1.0 req/s   kvfleet      TTFT p50 0.171 s  p90 0.220 s  hit rate 0.934
                prefix_tree  TTFT p50 0.204 s  p90 0.223 s  hit rate 0.934
                round_robin  TTFT p50 0.310 s  p90 0.862 s  hit rate 0.506
    0.5 req/s   p90 0.221 / 0.315 / 0.937 s (same order), hit rates 0.934 / 0.934 / 0.506
    p90_ttft_ratio_vs_round_robin 0.256 (0.236 at 0.5), p90_ttft_ratio_vs_prefix_tree 0.986 (0.701
    at 0.5), http_ttft_overhead_ratio 1.059 (TTFT p50 0.147 s driver, 0.155 s HTTP), 584 requests,
    0 lost. The run after it (load average 1.5-12): 0.214, 0.833 (kvfleet p90 0.204 s, prefix_tree
    0.245 s), 1.137, 584 requests, 0 lost.

Every measured kvfleet request found its prefix cached: its router's ``route_outcomes`` show no
decision below the best worker's hit (75 ``decode_only`` and 5 ``prefix`` hits at 1.0 req/s; the
misses are the warm-up's 2 unrelated prompts and 5 first sights). Before the guard change (commit
6a51cc6) 5-6 of kvfleet's 80 requests at 1.0 req/s were sent to a prefill worker without their
warmed prefix (TTFT 1.0-1.7 s; p90 0.505 s, ratio vs prefix_tree 1.986): the work guard compared
each prefill worker's recent work with the mean over all four workers, decode workers included,
and left an idle holder out (reproduced in tests/routing/test_guards.py). The p90 at this size is
sensitive to the machine's load: a run at load average 9-32 (its prefix_tree server's GCS died
under it, losing 58 requests) gave kvfleet p90 0.509 s from a 12-second stall that slowed 10
requests, all of them hits.
Without the prefix warm-up (two earlier runs) the first sights and the requests queued behind
them set every policy's p90 (ratios vs round robin 0.38 and 1.03 at 1.0 req/s, vs prefix_tree
0.57 and 0.91, with the machine's load).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.bench import percentile  # noqa: E402  (the same interpolation as `kvfleet bench`)

log = logging.getLogger("serve_bench")

POLICIES = ("kvfleet", "prefix_tree", "round_robin")
BENCH_WORKERS = ("workers.num_prefill=2", "workers.num_decode=2")
TOOL = "guidellm"
SYLLABLES = ("ka", "lo", "mi", "ten", "ra", "vo", "sel", "dun", "pa", "ri", "ost", "eh", "ul", "bor",
             "fi", "gan", "te", "zu", "ni", "mar", "so", "quil", "ad", "nor")  # fmt: skip
URL_RE = re.compile(r"https?://[\w.\-]+:\d+")


# -- workload -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The shared-prefix request mix, in text; lengths are measured with the model's tokenizer."""

    num_prefixes: int = 5
    requests_per_prefix: int = 16
    prefix_tokens: int = 256
    suffix_tokens: int = 16
    max_tokens: int = 8
    in_flight: int = 2
    cache_fraction: float = 0.5
    warmup: int = 2
    warm_prefixes: bool = True
    seed: int = 0


def _words(rng: random.Random, tokenizer: Any, lead: str, target_tokens: int) -> str:
    """``lead`` followed by pseudo-words, grown until it encodes to ``target_tokens`` or more."""
    text = lead
    while len(tokenizer.encode(text)) < target_tokens:
        text += " " + "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
    return text


def build_prompts(workload: Workload, tokenizer: Any) -> tuple[list[str], list[str]]:
    """The prefixes, and every prefix asked ``requests_per_prefix`` distinct questions, shuffled
    once (seeded)."""
    rng = random.Random(workload.seed)
    prefixes = [_words(rng, tokenizer, f"Document {i}.", workload.prefix_tokens) + "\n"
                for i in range(workload.num_prefixes)]  # fmt: skip
    prompts = [
        prefix + _words(rng, tokenizer, f"Question {j}:", workload.suffix_tokens) + "?"
        for prefix in prefixes
        for j in range(workload.requests_per_prefix)
    ]
    rng.shuffle(prompts)
    return prefixes, prompts


def warmup_prompts(workload: Workload, tokenizer: Any, prefixes: list[str]) -> list[str]:
    """``warmup`` short unrelated prompts, then (``warm_prefixes``) each prefix once with a question
    of its own: every policy then starts measuring with each prefix computed once, as it placed
    it, so the p90 reflects the routing rather than the first sight of each prefix."""
    rng = random.Random(workload.seed + 1)
    prompts = [_words(rng, tokenizer, f"Warm-up {i}:", workload.suffix_tokens + 4) for i in range(workload.warmup)]
    if workload.warm_prefixes:
        prompts += [prefix + _words(rng, tokenizer, "Warm-up question:", workload.suffix_tokens) + "?"
                    for prefix in prefixes]  # fmt: skip
    return prompts


def sized_overrides(config: Any, workload: Workload, prompt_tokens: int, prefix_tokens: int) -> list[str]:
    """``--set`` overrides that size every worker's pool as ``kvfleet bench`` does."""
    from cluster.bench import Workload as ClusterWorkload
    from cluster.bench import sized_config
    from engine.core import resolve_model_directory
    from engine.model.arch import arch_from_hf_config
    from engine.model.kv_layout import build_kv_layout
    from engine.model.loader import read_hf_config

    arch = arch_from_hf_config(read_hf_config(resolve_model_directory(config)), config.model.sliding_window_override)
    dtype = "float32" if config.model.dtype == "auto" else config.model.dtype
    groups = list(build_kv_layout(arch, config.kv_cache.block_size, dtype).groups)
    shape = ClusterWorkload(
        num_prefixes=workload.num_prefixes,
        prefix_tokens=prefix_tokens,
        suffix_tokens=prompt_tokens - prefix_tokens,
        max_tokens=workload.max_tokens,
        concurrency=workload.in_flight,
        cache_fraction=workload.cache_fraction,
    )
    kv = sized_config(config, shape, groups).kv_cache
    if kv == config.kv_cache:
        return []
    out = [f"kv_cache.num_blocks={kv.num_blocks}", "kv_cache.memory_budget_mib=null"]
    if kv.pinning.budget_blocks != config.kv_cache.pinning.budget_blocks:
        out.append(f"kv_cache.pinning.budget_blocks={kv.pinning.budget_blocks}")
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


# -- the server ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``kvfleet serve`` as a subprocess on a free loopback port: started, ready (its URL printed
    and /health 200), stopped with SIGINT (SIGKILL to its process group if it does not exit)."""

    def __init__(self, kvfleet: str, config: str, overrides: Sequence[str], log_path: Path,
                 start_timeout_s: float = 900.0, stop_timeout_s: float = 90.0):  # fmt: skip
        self.port = free_port()
        self.cmd = [kvfleet, "serve", "--config", config]
        for override in [*overrides, f"serve.port={self.port}"]:
            self.cmd += ["--set", override]
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.url = ""
        self.start_s = 0.0
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Self:
        started = time.monotonic()
        log_file = self.log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                     start_new_session=True)  # fmt: skip
        log_file.close()
        found = threading.Event()
        threading.Thread(target=self._read_stdout, args=(found,), daemon=True).start()
        try:
            while not found.wait(0.5):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready; see {self.log_path}")
                if time.monotonic() - started > self.start_timeout_s:
                    raise TimeoutError(f"server not ready after {self.start_timeout_s:.0f} s; see {self.log_path}")
            while get_status(self.url, "/health") != 200:
                if time.monotonic() - started > self.start_timeout_s:
                    raise TimeoutError(f"{self.url}/health not 200 after {self.start_timeout_s:.0f} s")
                time.sleep(0.5)
        except BaseException:
            self.__exit__()
            raise
        self.start_s = time.monotonic() - started
        log.info("server ready at %s in %.1f s: %s", self.url, self.start_s, " ".join(self.cmd[1:]))
        return self

    def _read_stdout(self, found: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.with_suffix(".stdout").open("w") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                match = URL_RE.search(line)
                if match and f":{self.port}" in match.group(0) and not found.is_set():
                    self.url = match.group(0)
                    found.set()

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(self.stop_timeout_s)
            log.info("server stopped (exit %s) in %.1f s", proc.returncode, time.monotonic() - started)
        except subprocess.TimeoutExpired:
            log.warning("server did not exit %.0f s after SIGINT; killing its process group", self.stop_timeout_s)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def get_status(url: str, path: str) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def get_json(url: str, path: str) -> Any:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def served_model(url: str) -> str:
    return str(get_json(url, "/v1/models")["data"][0]["id"])


def cluster_stats(url: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """From ``/v1/stats``: requests finished and hit rate per worker (how a policy spread the
    load), and the router's decisions per reason as hit / miss / below_best (``below_best``: sent
    to a worker predicted to hold less of the prompt than another one; kvfleet's policy only)."""
    try:
        stats = get_json(url, "/v1/stats")
        workers = {w: {"finished": s.get("requests_finished"), "hit_rate": round(s.get("hit_rate") or 0.0, 4)}
                   for w, s in sorted(stats["workers"].items())}  # fmt: skip
        return workers, (stats.get("router") or {}).get("route_outcomes")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("no /v1/stats: %s", exc)
        return None, None


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """One streamed ``/v1/completions`` request; its TTFT (to the first chunk with text), latency
    and usage. Raises RuntimeError on an HTTP error or an error event."""
    parts = urlsplit(url)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        ttft, usage, text = None, None, ""
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            delta = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if delta and ttft is None:
                ttft = time.perf_counter() - start
            text += delta
            usage = chunk.get("usage") or usage
        latency = time.perf_counter() - start
        return {"ttft_s": ttft if ttft is not None else latency, "latency_s": latency, "usage": usage, "text": text}
    finally:
        conn.close()


# -- the load generator -------------------------------------------------------------------------
def find_tool(explicit: str | None) -> str:
    """guidellm's executable: --guidellm, $KVFLEET_GUIDELLM, next to this Python, then PATH."""
    candidates = [explicit, os.environ.get("KVFLEET_GUIDELLM"), str(Path(sys.executable).parent / TOOL),
                  shutil.which(TOOL)]  # fmt: skip
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit(f"serve_bench: no {TOOL} executable; install it (see this script's docstring) and pass "
                     f"--guidellm PATH or set KVFLEET_GUIDELLM")  # fmt: skip


def tool_version(tool: str) -> str:
    out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=300, env=tool_env()).stdout
    match = re.search(r"(\d+\.\d+[\w.\-+]*)", out)
    return match.group(1) if match else out.strip()


def pinned_version() -> str | None:
    """The exact version pyproject.toml's ``bench`` extra pins the load generator at."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    for requirement in extras.get("bench", []):
        name, _, version = requirement.partition("==")
        if name.strip().lower() == TOOL:
            return version.strip()
    return None


def tool_env() -> dict[str, str]:
    """guidellm offline (the tokenizer is a local directory), one worker process (2-core box)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}


def run_tool(tool: str, url: str, model: str, data: Path, tokenizer_dir: Path, rate: float, count: int,
             out_dir: Path) -> dict[str, Any]:  # fmt: skip
    """guidellm at a constant ``rate`` for ``count`` requests of ``data``; its benchmark report."""
    report = out_dir / "report.json"
    scenario = {
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
                        "http2": False, "timeout": 600.0, "extras": {"body": {"temperature": 0.0}}},  # fmt: skip
            "profile": {"kind": "constant", "rate": [rate]},
            "constraints": [{"kind": "max_requests", "count": count}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "data": [{"kind": "json_file", "path": str(data)}],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }
    (out_dir / "scenario.json").write_text(json.dumps(scenario, indent=1))
    cmd = [tool, "run", "--config", str(out_dir / "scenario.json"), "--disable-console-interactive"]
    with (out_dir / "guidellm.log").open("w") as out:
        done = subprocess.run(cmd, cwd=out_dir, stdout=out, stderr=subprocess.STDOUT, env=tool_env(),
                              timeout=count / rate + 600)  # fmt: skip
    if done.returncode != 0 or not report.is_file():
        raise RuntimeError(f"{TOOL} exited with {done.returncode}; see {out_dir / 'guidellm.log'}")
    return json.loads(report.read_text())["benchmarks"][0]


def summarize_report(benchmark: dict[str, Any], sent: int) -> dict[str, Any]:
    """TTFT p50/p90, latency, hit rate, throughput and losses from one guidellm benchmark."""
    requests = benchmark["requests"]
    ok = requests.get("successful") or []
    failed = [*(requests.get("errored") or []), *(requests.get("incomplete") or [])]
    for r in failed[:3]:
        log.warning("failed request: %s", (r.get("info") or {}).get("error"))
    ttfts = [r["time_to_first_token_ms"] / 1000 for r in ok if r.get("time_to_first_token_ms") is not None]
    latencies = [r["request_latency"] for r in ok if r.get("request_latency") is not None]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    output = sum(r.get("output_tokens") or 0 for r in ok)
    duration = float(benchmark.get("duration") or 0.0)
    return {
        "sent": sent,
        "completed": len(ok),
        "lost": sent - len(ok),
        "seconds": round(duration, 2),
        "achieved_rps": round(len(ok) / duration, 3) if duration else None,
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
        "ttft_max_s": round(max(ttfts), 4) if ttfts else None,
        "latency_p50_s": round(percentile(latencies, 0.5), 4),
        "output_tokens_per_s": round(output / duration, 2) if duration else None,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
    }


# -- the runs -----------------------------------------------------------------------------------
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
            report = run_tool(self.tool, server.url, model, self.out_dir / "prompts.jsonl", self.tokenizer_dir,
                              rate, len(self.prompts), run_dir)  # fmt: skip
            workers, routes = cluster_stats(server.url)
        result = {"policy": policy, "rate_rps": rate, **summarize_report(report, len(self.prompts)),
                  "server_start_s": round(server.start_s, 1), "loadavg_1m": round(os.getloadavg()[0], 2),
                  "workers": workers, "route_outcomes": routes}  # fmt: skip
        self.sent += result["sent"]
        self.lost += result["lost"]
        log.info("%s: TTFT p50 %.3f s p90 %.3f s, hit rate %s, %d lost", name, result["ttft_p50_s"],
                 result["ttft_p90_s"], result["hit_rate"], result["lost"])  # fmt: skip
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
                except Exception as exc:
                    self.lost += 1
                    log.warning("%s request failed: %s", side, exc)

            async def drive() -> None:
                for prompt in self.warmups:
                    self.sent += 1
                    await cluster.agenerate(prompt, sampling)
                for prompt in self.prompts[:count]:
                    await timed("driver", first_text_s(cluster, prompt, sampling), driver)
                    await timed("HTTP", http_first_text_s(server.url, model, prompt, self.workload.max_tokens),
                                http_ttfts)  # fmt: skip

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


def summary(runs: dict[str, dict[str, dict[str, Any]]], rate: float) -> dict[str, Any]:
    """kvfleet's p90 TTFT over each baseline's at ``rate`` (and at every rate, under ``by_rate``)."""
    key = f"{rate:g}"
    ours = runs.get("kvfleet", {})
    out: dict[str, Any] = {}
    for base in ("round_robin", "prefix_tree"):
        theirs = runs.get(base, {})
        out[f"p90_ttft_ratio_vs_{base}"] = ratio((ours.get(key) or {}).get("ttft_p90_s"),
                                                 (theirs.get(key) or {}).get("ttft_p90_s"))  # fmt: skip
        out[f"p90_ttft_ratio_vs_{base}_by_rate"] = {
            r: ratio(ours[r]["ttft_p90_s"], theirs[r]["ttft_p90_s"]) for r in ours if r in theirs
        }
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="local", help="preset name or YAML path (default: local)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every server and the driver cluster (repeatable)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated router policies")
    p.add_argument("--rates", default="0.5,1.0", help="comma-separated request rates (requests/s), low to high")
    p.add_argument("--num-prefixes", type=int, default=d.num_prefixes)
    p.add_argument("--requests-per-prefix", type=int, default=d.requests_per_prefix)
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    p.add_argument("--suffix-tokens", type=int, default=d.suffix_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--in-flight", type=int, default=d.in_flight, help="requests in flight the pools leave room for")
    p.add_argument("--cache-fraction", type=float, default=d.cache_fraction,
                   help="each worker's pool as a share of the prefix set (0: the config's own size)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="short unrelated requests before each run")
    p.add_argument("--no-warm-prefixes", dest="warm_prefixes", action="store_false",
                   help="do not send each prefix once before each run (first sights land in the measured run)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--overhead-requests", type=int, default=24,
                   help="sequential requests for the HTTP-vs-driver TTFT (0: skip)")
    p.add_argument("--guidellm", default=None, help="guidellm executable (default: $KVFLEET_GUIDELLM, then PATH)")
    p.add_argument("--kvfleet", default=None, help="kvfleet executable (default: next to this Python, then PATH)")
    p.add_argument("--out-dir", default=None, help="where reports and server logs go (default: a new temp dir)")
    return p.parse_args(argv)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    args = parse_args(argv)
    started, load_start = time.monotonic(), round(os.getloadavg()[0], 2)
    from configs import load_config
    from engine.core import resolve_model_directory
    from engine.tokenizer import load_tokenizer

    workload = Workload(args.num_prefixes, args.requests_per_prefix, args.prefix_tokens, args.suffix_tokens,
                        args.max_tokens, args.in_flight, args.cache_fraction, args.warmup, args.warm_prefixes,
                        args.seed)  # fmt: skip
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
    tool = find_tool(args.guidellm)
    version, pinned = tool_version(tool), pinned_version()
    if pinned and version != pinned:
        log.warning("%s %s at %s, but pyproject.toml's bench extra pins %s", TOOL, version, tool, pinned)
    kvfleet = args.kvfleet or next((c for c in (str(Path(sys.executable).parent / "kvfleet"), shutil.which("kvfleet"))
                                    if c and Path(c).is_file()), "kvfleet")  # fmt: skip
    overrides = [*BENCH_WORKERS, *args.overrides]
    config = load_config(args.config, overrides)
    model_dir = resolve_model_directory(config)
    tokenizer = load_tokenizer(model_dir, 0)
    prefixes, prompts = build_prompts(workload, tokenizer)
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    prefix_len = max(len(tokenizer.encode(p.split("\n")[0] + "\n")) for p in prompts)
    overrides += sized_overrides(config, workload, max(lengths), prefix_len)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="serve_bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "prompts.jsonl").open("w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt, "output_tokens_count": workload.max_tokens}) + "\n")
    log.info("%s %s (%s); %d prompts of %d-%d tokens (prefixes %d); overrides %s; output in %s",
             TOOL, version, tool, len(prompts), min(lengths), max(lengths), prefix_len, overrides, out_dir)  # fmt: skip
    bench = Bench(kvfleet, args.config, overrides, tool, model_dir, workload, prompts,
                  warmup_prompts(workload, tokenizer, prefixes), out_dir)  # fmt: skip

    runs: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in policies}
    for rate in rates:  # policies interleaved at each rate, so a drift in the machine's load hits all alike
        for policy in policies:
            try:
                result = bench.run_policy(policy, rate)
            except Exception as exc:
                log.exception("%s at %g req/s failed", policy, rate)
                bench.sent += len(prompts)
                bench.lost += len(prompts)
                result = {"policy": policy, "rate_rps": rate, "error": f"{type(exc).__name__}: {exc}"}
            runs[policy][f"{rate:g}"] = result
            print(json.dumps(result), flush=True)
    overhead: dict[str, Any] = {}
    if args.overhead_requests > 0:
        try:
            overhead = bench.http_overhead(args.overhead_requests)
        except Exception as exc:
            log.exception("HTTP overhead measurement failed")
            overhead = {"error": f"{type(exc).__name__}: {exc}"}
    final = {
        "tool": TOOL,
        "tool_version": version,
        **summary(runs, rates[-1]),
        "ratio_rate_rps": rates[-1],
        "http_ttft_overhead_ratio": overhead.get("http_ttft_overhead_ratio"),
        "requests": bench.sent,
        "lost": bench.lost,
        "runs": runs,
        "http_overhead": overhead,
        "workload": {**asdict(workload), "prompt_tokens": [min(lengths), max(lengths)], "prefix_tokens_measured": prefix_len},
        "config": {"preset": args.config, "overrides": overrides},
        "loadavg_1m": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    print(json.dumps(final), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
