"""Result parsing of ``benchmarks/serve_bench.py``: one guidellm benchmark report summarized.

Owns ``summarize_report`` (TTFT p50/p90, latency, hit rate, throughput and losses from guidellm's
JSON report) and ``ratio`` (the rounded ratio of two optional numbers the summaries report).
"""

from __future__ import annotations

import logging
from typing import Any

from benchmarks.support.stats import percentile

log = logging.getLogger("serve_bench")


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


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
