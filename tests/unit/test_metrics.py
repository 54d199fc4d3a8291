"""actors.metrics: the no-op path (no Ray), the wiring to a metrics backend, input checks.

No Ray cluster is started: the Ray path is checked with a recording fake of ``ray.util.metrics``
and by constructing and feeding the real ``ray.util.metrics`` classes, which validate names,
tag keys and histogram boundaries themselves.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

import pytest

from actors import metrics as m
from actors.metrics import TAG_KEYS, RouterMetrics, WorkerMetrics

PROMETHEUS_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


class FakeMetric:
    def __init__(self, kind: str, name: str, description: str = "", boundaries: Any = None, tag_keys: Any = None):
        self.kind, self.name, self.description = kind, name, description
        self.boundaries, self.tag_keys = boundaries, tag_keys
        self.calls: list[tuple[str, float, dict[str, str]]] = []

    def _record(self, op: str, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        self.calls.append((op, value, dict(tags)))

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        assert value > 0, "Ray counters reject values <= 0"
        self._record("inc", value, tags or {})

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._record("set", value, tags or {})

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._record("observe", value, tags or {})


class FakeBackend:
    """Stands in for ``ray.util.metrics``: records every metric made and every call on it."""

    def __init__(self) -> None:
        self.made: dict[str, FakeMetric] = {}

    def _make(self, kind: str, name: str, **kwargs: Any) -> FakeMetric:
        assert name not in self.made, f"{name} created twice"
        self.made[name] = FakeMetric(kind, name, **kwargs)
        return self.made[name]

    def Counter(self, name: str, **kwargs: Any) -> FakeMetric:
        return self._make("counter", name, **kwargs)

    def Gauge(self, name: str, **kwargs: Any) -> FakeMetric:
        return self._make("gauge", name, **kwargs)

    def Histogram(self, name: str, **kwargs: Any) -> FakeMetric:
        return self._make("histogram", name, **kwargs)


def _exercise_worker(metrics: WorkerMetrics) -> None:
    metrics.record_request_finished(ttft_s=0.25, prompt_tokens=100, output_tokens=16, cached_tokens=64)
    metrics.record_request_finished(ttft_s=0.05, prompt_tokens=20, output_tokens=4)
    metrics.record_request_aborted()
    metrics.record_transfer(nbytes=1 << 20, seconds=0.002)
    metrics.set_cache_stats(free_blocks=900, pinned_blocks=12, hit_rate=0.5)
    metrics.set_queue_stats(running=3, waiting=1)


def _exercise_router(metrics: RouterMetrics) -> None:
    metrics.record_request_routed(prompt_tokens=100, predicted_hit_tokens=64, disaggregated=True)
    metrics.record_request_routed(prompt_tokens=20, predicted_hit_tokens=0, disaggregated=False, given_up_tokens=16)
    metrics.record_request_finished(ttft_s=0.3, output_tokens=16)
    metrics.record_request_failed()
    metrics.set_pin_stats(pinned_prefixes=2, pinned_blocks=40)


def test_without_ray_it_is_a_noop_that_keeps_in_process_values() -> None:
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "unit tests run without a Ray cluster"
    worker = WorkerMetrics("decode-0", "decode")
    assert not worker.exports_to_ray
    _exercise_worker(worker)
    snap = worker.snapshot()
    assert snap["kvfleet_requests_finished_total"] == 2
    assert snap["kvfleet_requests_aborted_total"] == 1
    assert snap["kvfleet_prompt_tokens_total"] == 120
    assert snap["kvfleet_prefix_hit_tokens_total"] == 64
    assert snap["kvfleet_generated_tokens_total"] == 20
    assert snap["kvfleet_ttft_seconds"] == {"count": 2, "sum": pytest.approx(0.3)}
    assert snap["kvfleet_kv_transfers_total"] == 1
    assert snap["kvfleet_kv_transfer_bytes_total"] == 1 << 20
    assert snap["kvfleet_kv_transfer_seconds"] == {"count": 1, "sum": pytest.approx(0.002)}
    assert (snap["kvfleet_kv_free_blocks"], snap["kvfleet_kv_pinned_blocks"], snap["kvfleet_prefix_hit_rate"]) == (
        900,
        12,
        0.5,
    )
    assert (snap["kvfleet_running_requests"], snap["kvfleet_waiting_requests"]) == (3, 1)

    router = RouterMetrics(backend=None)
    _exercise_router(router)
    snap = router.snapshot()
    assert snap["kvfleet_router_disaggregated_requests_total"] == 1
    assert snap["kvfleet_router_decode_only_requests_total"] == 1
    assert snap["kvfleet_router_predicted_hit_tokens_total"] == 64
    assert snap["kvfleet_router_hit_tokens_given_up_total"] == 16
    assert snap["kvfleet_router_prompt_tokens_total"] == 120
    assert snap["kvfleet_router_ttft_seconds"] == {"count": 1, "sum": pytest.approx(0.3)}
    assert (snap["kvfleet_router_pinned_prefixes"], snap["kvfleet_router_pinned_blocks"]) == (2, 40)


def test_without_ray_installed_the_backend_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert m.ray_metrics_backend() is None
    assert not WorkerMetrics("p0", "prefill").exports_to_ray


def test_with_ray_initialised_auto_picks_ray_util_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    ray_metrics = pytest.importorskip("ray.util.metrics")
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert m.ray_metrics_backend() is ray_metrics


def test_every_series_is_tagged_and_fed_through_the_backend() -> None:
    backend = FakeBackend()
    worker = WorkerMetrics("prefill-1", "prefill", backend=backend)
    assert worker.exports_to_ray
    _exercise_worker(worker)
    router_backend = FakeBackend()
    _exercise_router(RouterMetrics("router-a", backend=router_backend))

    for made, tags in (
        (backend.made, {"worker_id": "prefill-1", "role": "prefill"}),
        (router_backend.made, {"worker_id": "router-a", "role": "router"}),
    ):
        for name, metric in made.items():
            assert PROMETHEUS_NAME.match(name) and name.startswith("kvfleet_"), name
            assert tuple(metric.tag_keys) == TAG_KEYS
            assert metric.description, name
            assert (metric.kind == "counter") == name.endswith("_total"), name
            if metric.kind == "histogram":
                assert metric.boundaries == sorted(metric.boundaries) and metric.boundaries[0] > 0
            assert metric.calls, f"{name} never recorded"
            assert all(call_tags == tags for _, _, call_tags in metric.calls), name

    made = backend.made
    assert [c[1] for c in made["kvfleet_ttft_seconds"].calls] == [0.25, 0.05]
    assert [c[1] for c in made["kvfleet_kv_transfer_bytes_total"].calls] == [1 << 20]
    assert made["kvfleet_kv_free_blocks"].calls == [("set", 900, {"worker_id": "prefill-1", "role": "prefill"})]
    # a zero increment (no cached tokens on the second request) never reaches a Ray counter
    assert [c[1] for c in made["kvfleet_prefix_hit_tokens_total"].calls] == [64]


def test_the_real_ray_metric_classes_accept_the_metric_set() -> None:
    ray_metrics = pytest.importorskip("ray.util.metrics")
    import ray

    worker = WorkerMetrics("decode-9", "decode", backend=ray_metrics)
    router = RouterMetrics("router-9", backend=ray_metrics)
    _exercise_worker(worker)  # without a connected Ray the records are dropped, but names,
    _exercise_router(router)  # tag keys, tags and boundaries are still validated by Ray
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "call",
    [
        lambda w: w.record_request_finished(ttft_s=-0.1, prompt_tokens=1, output_tokens=1),
        lambda w: w.record_request_finished(ttft_s=math.nan, prompt_tokens=1, output_tokens=1),
        lambda w: w.record_request_finished(ttft_s=0.1, prompt_tokens=10, output_tokens=-1),
        lambda w: w.record_request_finished(ttft_s=0.1, prompt_tokens=10, output_tokens=1, cached_tokens=11),
        lambda w: w.record_transfer(nbytes=-1, seconds=0.1),
        lambda w: w.record_transfer(nbytes=10, seconds=math.inf),
        lambda w: w.set_cache_stats(free_blocks=1, pinned_blocks=0, hit_rate=1.5),
        lambda w: w.set_cache_stats(free_blocks=-1, pinned_blocks=0, hit_rate=0.5),
        lambda w: w.set_queue_stats(running=True, waiting=0),
    ],
)
def test_bad_values_raise_and_record_nothing(call: Any) -> None:
    backend = FakeBackend()
    worker = WorkerMetrics("decode-0", "decode", backend=backend)
    before = worker.snapshot()
    with pytest.raises(ValueError):
        call(worker)
    assert worker.snapshot() == before
    assert all(not metric.calls for metric in backend.made.values())


def test_bad_identity_and_router_inputs_raise() -> None:
    with pytest.raises(ValueError, match="role"):
        WorkerMetrics("w", "router", backend=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="worker_id"):
        WorkerMetrics("", "decode", backend=None)
    router = RouterMetrics(backend=None)
    with pytest.raises(ValueError, match="predicted_hit_tokens"):
        router.record_request_routed(prompt_tokens=4, predicted_hit_tokens=5, disaggregated=True)
    with pytest.raises(ValueError, match="pinned_blocks"):
        router.set_pin_stats(pinned_prefixes=1, pinned_blocks=-2)
