"""Prometheus metrics of the worker and router actors, through ``ray.util.metrics``.

Every series is tagged with ``worker_id`` and ``role`` (``prefill``, ``decode`` or ``router``),
so one dashboard query splits by worker or by role. Ray exports them from each node's metrics
agent (port 8080 on KubeRay pods). Names start with ``kvfleet_``; counters end in ``_total``.

Outside a Ray process (engine tests, a plain Python session) or without Ray installed the same
classes work with no Ray metrics at all: every call only updates the in-process values that
``snapshot()`` returns. The backend is picked once, at construction:

    metrics = WorkerMetrics(worker_id="decode-0", role="decode")   # Ray metrics iff ray is initialised
    metrics.record_request_finished(ttft_s=0.12, prompt_tokens=812, output_tokens=64)
    metrics.set_cache_stats(free_blocks=1700, pinned_blocks=48, hit_rate=0.62)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

TAG_KEYS = ("worker_id", "role")
WorkerRole = Literal["prefill", "decode"]

# Histogram bucket upper bounds (seconds). TTFT spans a cached decode-only hit (milliseconds) to
# a long prefill queued behind others; a KV transfer spans one block over shared memory to a
# long prompt over TCP.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_AUTO = "auto"


def ray_metrics_backend() -> Any | None:
    """``ray.util.metrics`` when this process is connected to Ray (driver or actor), else None."""
    try:
        import ray
        from ray.util import metrics
    except ImportError:
        return None
    return metrics if ray.is_initialized() else None


class _Series:
    """One metric with constant tags: the Ray metric (if any) plus the in-process value."""

    def __init__(
        self,
        backend: Any | None,
        kind: Literal["counter", "gauge", "histogram"],
        name: str,
        description: str,
        tags: dict[str, str],
        boundaries: Sequence[float] = (),
    ):
        self.kind = kind
        self.name = name
        self._tags = tags
        self.value = 0.0  # counter: running total; gauge: last value; histogram: sum
        self.count = 0  # histogram observations
        self._ray: Any | None = None
        if backend is None:
            return
        if kind == "counter":
            self._ray = backend.Counter(name, description=description, tag_keys=TAG_KEYS)
        elif kind == "gauge":
            self._ray = backend.Gauge(name, description=description, tag_keys=TAG_KEYS)
        else:
            self._ray = backend.Histogram(name, description=description, boundaries=list(boundaries), tag_keys=TAG_KEYS)

    def inc(self, amount: float) -> None:
        _check_finite(self.name, amount, minimum=0.0)
        if amount == 0:
            return  # Ray counters reject 0; nothing to record anyway
        self.value += amount
        if self._ray is not None:
            self._ray.inc(amount, tags=self._tags)

    def set(self, value: float) -> None:
        _check_finite(self.name, value)
        self.value = float(value)
        if self._ray is not None:
            self._ray.set(value, tags=self._tags)

    def observe(self, value: float) -> None:
        _check_finite(self.name, value, minimum=0.0)
        self.value += value
        self.count += 1
        if self._ray is not None:
            self._ray.observe(value, tags=self._tags)

    def snapshot(self) -> float | dict[str, float]:
        if self.kind == "histogram":
            return {"count": self.count, "sum": self.value}
        return self.value


def _check_finite(name: str, value: float, minimum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number (got {value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum} (got {value!r})")


class _Metrics:
    """The metric set of one actor: owns its series and their constant ``worker_id``/``role`` tags."""

    def __init__(self, worker_id: str, role: str, backend: Any = _AUTO):
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id: must be a non-empty string (got {worker_id!r})")
        self.worker_id = worker_id
        self.role = role
        self._backend = ray_metrics_backend() if isinstance(backend, str) and backend == _AUTO else backend
        self._tags = {"worker_id": worker_id, "role": role}
        self._series: dict[str, _Series] = {}

    @property
    def exports_to_ray(self) -> bool:
        """True when the series are also Ray metrics (False: in-process values only)."""
        return self._backend is not None

    def _add(
        self,
        kind: Literal["counter", "gauge", "histogram"],
        name: str,
        description: str,
        boundaries: Sequence[float] = (),
    ) -> _Series:
        series = _Series(self._backend, kind, name, description, self._tags, boundaries)
        self._series[name] = series
        return series

    def snapshot(self) -> dict[str, float | dict[str, float]]:
        """In-process values by metric name: counter totals, last gauge values, histogram count/sum."""
        return {name: series.snapshot() for name, series in self._series.items()}


class WorkerMetrics(_Metrics):
    """Metrics of one prefill or decode worker actor.

    Owns the worker's request and token counters, its TTFT histogram, the KV-cache gauges
    (free and pinned blocks, prefix hit rate, running and waiting requests) and the KV-transfer
    counters and latency histogram. The actor calls the ``record_*``/``set_*`` methods from its
    engine loop; nothing here reads the engine.
    """

    def __init__(self, worker_id: str, role: WorkerRole, backend: Any = _AUTO):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: must be 'prefill' or 'decode' (got {role!r})")
        super().__init__(worker_id, role, backend)
        self._requests = self._add("counter", "kvfleet_requests_finished_total", "Requests finished on this worker.")
        self._aborted = self._add("counter", "kvfleet_requests_aborted_total", "Requests aborted on this worker.")
        self._prompt_tokens = self._add("counter", "kvfleet_prompt_tokens_total", "Prompt tokens of finished requests.")
        self._cached_tokens = self._add(
            "counter", "kvfleet_prefix_hit_tokens_total", "Prompt tokens served from the prefix cache."
        )
        self._output_tokens = self._add("counter", "kvfleet_generated_tokens_total", "Tokens generated.")
        self._ttft = self._add(
            "histogram", "kvfleet_ttft_seconds", "Time from arrival on the worker to first token.", TTFT_BUCKETS_S
        )
        self._hit_rate = self._add("gauge", "kvfleet_prefix_hit_rate", "Prefix-cache token hit rate (0..1).")
        self._free_blocks = self._add("gauge", "kvfleet_kv_free_blocks", "Free KV-cache blocks.")
        self._pinned_blocks = self._add("gauge", "kvfleet_kv_pinned_blocks", "KV-cache blocks in the pinned tier.")
        self._running = self._add("gauge", "kvfleet_running_requests", "Requests running on this worker.")
        self._waiting = self._add("gauge", "kvfleet_waiting_requests", "Requests waiting (queued or for KV).")
        self._transfers = self._add("counter", "kvfleet_kv_transfers_total", "KV transfers completed.")
        self._transfer_bytes = self._add("counter", "kvfleet_kv_transfer_bytes_total", "KV bytes transferred.")
        self._transfer_seconds = self._add(
            "histogram", "kvfleet_kv_transfer_seconds", "Duration of one KV transfer.", TRANSFER_BUCKETS_S
        )

    def record_request_finished(
        self, ttft_s: float, prompt_tokens: int, output_tokens: int, *, cached_tokens: int = 0
    ) -> None:
        """One request finished here: its TTFT, prompt and generated token counts, prefix hit."""
        _check_finite("ttft_s", ttft_s, minimum=0)
        for name, count in (
            ("prompt_tokens", prompt_tokens),
            ("output_tokens", output_tokens),
            ("cached_tokens", cached_tokens),
        ):
            _check_finite(name, count, minimum=0)
        if cached_tokens > prompt_tokens:
            raise ValueError(f"cached_tokens: must be <= prompt_tokens ({prompt_tokens}) (got {cached_tokens})")
        self._requests.inc(1)
        self._ttft.observe(ttft_s)
        self._prompt_tokens.inc(prompt_tokens)
        self._cached_tokens.inc(cached_tokens)
        self._output_tokens.inc(output_tokens)

    def record_request_aborted(self) -> None:
        self._aborted.inc(1)

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        """One KV read that brought a request's KV into this (decode) worker: its bytes and seconds."""
        _check_finite("nbytes", nbytes, minimum=0)
        _check_finite("seconds", seconds, minimum=0)
        self._transfers.inc(1)
        self._transfer_bytes.inc(nbytes)
        self._transfer_seconds.observe(seconds)

    def set_cache_stats(self, free_blocks: int, pinned_blocks: int, hit_rate: float) -> None:
        """The KV cache right now: free blocks, pinned blocks, prefix token hit rate in [0, 1]."""
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"hit_rate: must be in [0, 1] (got {hit_rate!r})")
        _check_finite("free_blocks", free_blocks, minimum=0)
        _check_finite("pinned_blocks", pinned_blocks, minimum=0)
        self._free_blocks.set(free_blocks)
        self._pinned_blocks.set(pinned_blocks)
        self._hit_rate.set(hit_rate)

    def set_queue_stats(self, running: int, waiting: int) -> None:
        _check_finite("running", running, minimum=0)
        _check_finite("waiting", waiting, minimum=0)
        self._running.set(running)
        self._waiting.set(waiting)


class RouterMetrics(_Metrics):
    """Metrics of the router actor (``role="router"``).

    Owns the counters of routed, finished and failed requests (routed ones split by path:
    ``disaggregated`` through a prefill worker, or ``decode_only``), the predicted prefix-hit
    and prompt token counters (their ratio is the predicted hit rate), the end-to-end TTFT
    histogram as the router sees it, and the gauges of cluster-wide pinned prefixes.
    """

    def __init__(self, router_id: str = "router", backend: Any = _AUTO):
        super().__init__(router_id, "router", backend)
        self._disaggregated = self._add(
            "counter", "kvfleet_router_disaggregated_requests_total", "Requests routed through a prefill worker."
        )
        self._decode_only = self._add(
            "counter", "kvfleet_router_decode_only_requests_total", "Requests prefilled on their decode worker."
        )
        self._finished = self._add("counter", "kvfleet_router_requests_finished_total", "Requests finished.")
        self._failed = self._add("counter", "kvfleet_router_requests_failed_total", "Requests that failed.")
        self._prompt_tokens = self._add("counter", "kvfleet_router_prompt_tokens_total", "Prompt tokens routed.")
        self._predicted_hit = self._add(
            "counter", "kvfleet_router_predicted_hit_tokens_total", "Prompt tokens predicted cached where routed."
        )
        self._given_up = self._add(
            "counter",
            "kvfleet_router_hit_tokens_given_up_total",
            "Predicted hit tokens a placement gave up: the best worker's hit less the chosen one's.",
        )
        self._output_tokens = self._add("counter", "kvfleet_router_generated_tokens_total", "Tokens streamed back.")
        self._ttft = self._add(
            "histogram",
            "kvfleet_router_ttft_seconds",
            "Time from submit to first token, at the router.",
            TTFT_BUCKETS_S,
        )
        self._pinned_prefixes = self._add("gauge", "kvfleet_router_pinned_prefixes", "Pinned prefixes.")
        self._pinned_blocks = self._add(
            "gauge", "kvfleet_router_pinned_blocks", "Blocks held by pinned prefixes, all replicas."
        )

    def record_request_routed(
        self, prompt_tokens: int, predicted_hit_tokens: int, *, disaggregated: bool, given_up_tokens: int = 0
    ) -> None:
        """A placement decision: the prompt size, the hit the index predicts, the path taken and the
        hit tokens it gave up (the best worker's predicted hit less the chosen one's)."""
        _check_finite("prompt_tokens", prompt_tokens, minimum=0)
        _check_finite("predicted_hit_tokens", predicted_hit_tokens, minimum=0)
        _check_finite("given_up_tokens", given_up_tokens, minimum=0)
        if predicted_hit_tokens > prompt_tokens:
            raise ValueError(
                f"predicted_hit_tokens: must be <= prompt_tokens ({prompt_tokens}) (got {predicted_hit_tokens})"
            )
        (self._disaggregated if disaggregated else self._decode_only).inc(1)
        self._prompt_tokens.inc(prompt_tokens)
        self._predicted_hit.inc(predicted_hit_tokens)
        self._given_up.inc(given_up_tokens)

    def record_request_finished(self, ttft_s: float, output_tokens: int) -> None:
        _check_finite("ttft_s", ttft_s, minimum=0)
        _check_finite("output_tokens", output_tokens, minimum=0)
        self._finished.inc(1)
        self._ttft.observe(ttft_s)
        self._output_tokens.inc(output_tokens)

    def record_request_failed(self) -> None:
        self._failed.inc(1)

    def set_pin_stats(self, pinned_prefixes: int, pinned_blocks: int) -> None:
        _check_finite("pinned_prefixes", pinned_prefixes, minimum=0)
        _check_finite("pinned_blocks", pinned_blocks, minimum=0)
        self._pinned_prefixes.set(pinned_prefixes)
        self._pinned_blocks.set(pinned_blocks)
