"""The HTTP client of ``benchmarks/serve_bench.py``: requests to a running ``kvfleet serve``.

Owns the plain GETs (``get_status``, ``get_json``), the served model's name (``served_model``),
the per-worker and router statistics of ``/v1/stats`` (``cluster_stats``) and one streamed
``/v1/completions`` request timed to its first text (``stream_completion``).
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("serve_bench")


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
        workers = {
            w: {"finished": s.get("requests_finished"), "hit_rate": round(s.get("hit_rate") or 0.0, 4)}
            for w, s in sorted(stats["workers"].items())
        }
        return workers, (stats.get("router") or {}).get("route_outcomes")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("no /v1/stats: %s", exc)
        return None, None


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """One streamed ``/v1/completions`` request; its TTFT (to the first chunk with text), latency
    and usage. Raises RuntimeError on an HTTP error or an error event."""
    parts = urlsplit(url)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
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
            data = line[len("data:") :].strip()
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
