"""Prometheus metrics of the HTTP API (``GET /metrics``), with ``prometheus_client``.

Request-level series (requests by endpoint and status, prompt / generated / cached tokens, TTFT,
inter-token and end-to-end latency histograms, requests in flight) are counted by the ingress replica that
served the request. Cluster-level gauges (queue depth, running requests, hit rate, free and
pinned blocks, KV transfer bytes) are read from ``Cluster.astats()`` at scrape time, and so are
the KV tier series per worker (labels ``worker_id`` and ``role``, as ``kvfleet_worker_hit_rate``;
``cluster.tier_stats``): prompt tokens served from each tier (label ``tier``: device / host), and
for workers with a host tier (``kv_cache.offload``) its blocks and cached blocks per pool, the
blocks it took, refreshed, dropped and promoted, the bytes and host-side seconds of its copies
each way (label ``direction``: offload / promote). Every name starts with ``kvfleet_``; counters
end in ``_total`` in the exposition.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.tier_stats import BLOCK_MOVES

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ClusterGauges:
    """A collector exposing the last cluster stats snapshot (set before each scrape)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None

    def collect(self) -> Any:
        stats = self.snapshot
        if stats is None:
            return
        totals = stats["totals"]
        yield _gauge(
            "kvfleet_queue_depth", "Requests waiting on the workers (queued or waiting for KV).", totals["queued"]
        )
        yield _gauge("kvfleet_running_requests", "Requests running on the workers.", totals["running"])
        yield _gauge(
            "kvfleet_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, share.", totals["hit_rate"]
        )
        yield _gauge("kvfleet_free_blocks", "Free KV blocks over every worker.", totals["free_blocks"])
        yield _gauge("kvfleet_pinned_blocks", "Pinned KV blocks over every worker.", totals["pinned_blocks"])
        yield _gauge(
            "kvfleet_kv_transfer_bytes",
            "KV bytes decode workers pulled from prefill workers (so far).",
            totals["transfer_bytes"],
        )
        yield CounterMetricFamily(
            "kvfleet_kv_transfers", "KV reads decode workers finished (so far).", value=float(totals["transfers"])
        )
        yield CounterMetricFamily(
            "kvfleet_kv_transfer_seconds",
            "Seconds decode workers spent in finished KV reads.",
            value=float(totals["transfer_seconds"]),
        )
        per_worker = GaugeMetricFamily(
            "kvfleet_worker_hit_rate", "Prefix cache hit rate per worker.", labels=["worker_id", "role"]
        )
        for worker_id, worker in stats["workers"].items():
            per_worker.add_metric([worker_id, worker["role"]], worker["hit_rate"])
        yield per_worker
        yield from _tier_families(stats["workers"])


class ServeMetrics:
    """Owns one replica's registry: request counters and histograms plus the cluster gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvfleet_http_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("kvfleet_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("kvfleet_generation_tokens", "Generated tokens.", registry=r)
        self.cached_tokens = Counter(
            "kvfleet_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.ttft = Histogram(
            "kvfleet_time_to_first_token_seconds",
            "Time to first token, from arrival.",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "kvfleet_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            buckets=ITL_BUCKETS_S,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "kvfleet_e2e_request_latency_seconds",
            "Request latency from arrival to its last token, per finished request.",
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "kvfleet_http_requests_in_flight", "Generation requests admitted, not finished.", registry=r
        )
        self.rejected = Counter(
            "kvfleet_http_requests_rejected", "Requests refused with 429 (queue bound full).", registry=r
        )
        self.cluster = ClusterGauges()
        r.register(self.cluster)

    def record_completion(self, prompt_tokens: int, output_tokens: int, cached_tokens: int, ttft_s: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.cached_tokens.inc(cached_tokens)
        if output_tokens:
            self.ttft.observe(ttft_s)

    def record_gap(self, gap_s: float, num_tokens: int) -> None:
        """Output tokens that arrived together ``gap_s`` after the previous ones."""
        if num_tokens <= 0:
            return
        per_token = gap_s / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def exposition(self, cluster_stats: dict[str, Any] | None) -> bytes:
        self.cluster.snapshot = cluster_stats
        return generate_latest(self.registry)


def _tier_families(workers: dict[str, Any]) -> Iterator[Metric]:
    """The KV tier series of every worker (``cluster.tier_stats`` built the values)."""
    labels = ["worker_id", "role"]
    hits = CounterMetricFamily(
        "kvfleet_worker_hit_tokens", "Prompt tokens a worker served from cache, per tier.", labels=[*labels, "tier"]
    )
    blocks = GaugeMetricFamily(
        "kvfleet_host_tier_blocks", "Usable blocks of a worker's host tier, per pool.", labels=[*labels, "pool"]
    )
    cached = GaugeMetricFamily(
        "kvfleet_host_tier_cached_blocks",
        "Blocks of a worker's host tier holding an evicted block, per pool.",
        labels=[*labels, "pool"],
    )
    occupancy = GaugeMetricFamily(
        "kvfleet_host_tier_occupancy", "Cached over usable blocks of a worker's host tier.", labels=labels
    )
    moves = CounterMetricFamily(
        "kvfleet_host_tier_block_moves",
        "Blocks a worker's host tier offloaded (took from the device), refreshed (held "
        "already), dropped (no free host block) and promoted (copied back).",
        labels=[*labels, "move"],
    )
    copied = CounterMetricFamily(
        "kvfleet_host_tier_copy_bytes", "Bytes copied between a worker's two tiers.", labels=[*labels, "direction"]
    )
    seconds = CounterMetricFamily(
        "kvfleet_host_tier_copy_seconds",
        "Host-side seconds of a worker's host tier copies (on CUDA: queueing them).",
        labels=[*labels, "direction"],
    )
    for worker_id, worker in workers.items():
        who = [worker_id, worker["role"]]
        for tier, tokens in (worker.get("hit_tokens_by_tier") or {}).items():
            hits.add_metric([*who, tier], float(tokens))
        host = worker.get("host_tier")
        if host is None:
            continue
        for p, pool in enumerate(host["pools"]):
            blocks.add_metric([*who, str(p)], pool["num_blocks"])
            cached.add_metric([*who, str(p)], pool["cached_blocks"])
        occupancy.add_metric(who, host["occupancy"])
        for move in BLOCK_MOVES:
            moves.add_metric([*who, move], float(host[f"{move}_blocks"]))
        for direction, bytes_key, seconds_key in (
            ("offload", "bytes_offloaded", "offload_seconds"),
            ("promote", "bytes_promoted", "promote_seconds"),
        ):
            copied.add_metric([*who, direction], float(host[bytes_key]))
            seconds.add_metric([*who, direction], float(host[seconds_key]))
    yield from (hits, blocks, cached, occupancy, moves, copied, seconds)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))
