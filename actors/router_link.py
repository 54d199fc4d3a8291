"""A worker's side of the router protocol: KV events and load reported after each step, pins
placed and removed on the router's word, full snapshots when the router asks. A mixin of
``EngineWorker``: everything here runs on the engine thread (the actor methods only enqueue)."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from actors.worker_types import _Tracked
from engine.routing import PinOn, WorkerLoad, WorkerSnapshot
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

LOAD_REPORT_INTERVAL_S = 0.05  # a changed load alone is reported at most this often
ROUTER_SYNC_TIMEOUT_S = 30.0


class RouterLink:
    """Reports to the router and executes its pin actions (state lives in ``EngineWorker``:
    ``engine``, ``_router``, ``_tracked``, the last report and load, ``metrics``)."""

    engine: Any
    worker_id: str
    metrics: Any
    _router: Any
    _tracked: dict[str, _Tracked]
    _last_report: Any
    _last_load: WorkerLoad | None
    _last_report_at: float

    def _submit(self, fn: Any, *args: Any) -> Any:
        raise NotImplementedError

    # -- router actions ----------------------------------------------------------------------------
    def pin(self, action: PinOn) -> None:
        """Make ``action``'s prefix resident (computing it if needed), pin it, tell the router."""
        self._submit(self._pin_on, action)

    def unpin(self, block_hashes: list[bytes], num_tokens: int) -> None:
        self._submit(self._unpin, block_hashes, num_tokens)

    def snapshot(self) -> None:
        """Send the router a full snapshot of the prefix cache (it lost events)."""
        self._submit(self._snapshot)

    # -- reports to the router ---------------------------------------------------------------------
    def _load(self) -> WorkerLoad:
        return WorkerLoad(*self.engine.load())

    def _report(self, force: bool = False, wait: bool = False) -> None:
        router = self._router
        if router is None:
            return
        events = self.engine.take_events()
        load = self._load()
        now = time.monotonic()
        changed = load != self._last_load
        if events or force or (changed and now - self._last_report_at >= LOAD_REPORT_INTERVAL_S):
            self._last_report = router.report.remote(self.worker_id, events, load)
            self._last_load, self._last_report_at = load, now
            if self.metrics is not None:
                self._update_gauges()
        if wait and self._last_report is not None:
            try:
                self._last_report.future().result(timeout=ROUTER_SYNC_TIMEOUT_S)
            except Exception as exc:  # the router is gone or slow: serve on, it resyncs later
                log.warning("%s: router report not acknowledged (%s)", self.worker_id, exc)

    def _update_gauges(self) -> None:
        assert self.metrics is not None
        gauges = self.engine.cache_gauges()
        self.metrics.set_cache_stats(gauges["free_blocks"], gauges["pinned_free_blocks"], gauges["hit_rate"])
        self.metrics.set_queue_stats(gauges["running"], gauges["waiting"])

    # -- pins --------------------------------------------------------------------------------------
    def _pin_on(self, action: PinOn) -> None:
        have = self.engine.cached_prefix_tokens(action.block_hashes, action.num_tokens)
        if have >= action.num_tokens or not action.token_ids:
            self._finish_pin(action)
            return
        # Compute the prefix here (+1 token: a request's hit search stops before its last token),
        # then pin it the moment the request finishes, before anything can evict it.
        request_id = f"pin-{action.pin_id}-{uuid.uuid4().hex[:8]}"
        tokens = list(action.token_ids) + [0]
        self.engine.add_request(request_id, tokens, SamplingParams(max_tokens=1, ignore_eos=True))
        self._tracked[request_id] = _Tracked(None, None, len(tokens), pin=action)

    def _finish_pin(self, action: PinOn) -> None:
        pinned = self.engine.pin_prefix(action.block_hashes, action.num_tokens)
        self._report(force=True)  # the pin's events reach the router before its result
        if self._router is not None:
            self._router.pin_result.remote(self.worker_id, action.pin_id, pinned, self.engine.event_seq)
        log.info("%s: pinned %d/%d tokens of pin %d", self.worker_id, pinned, action.num_tokens, action.pin_id)

    def _unpin(self, block_hashes: list[bytes], num_tokens: int) -> None:
        self.engine.unpin_prefix(block_hashes, num_tokens)
        self._report(force=True)

    def _snapshot(self) -> None:
        self._report(force=True)
        if self._router is not None:
            self._router.apply_snapshot.remote(self.worker_id, WorkerSnapshot(*self.engine.cache_snapshot()))
