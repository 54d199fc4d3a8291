"""A worker's side of the router protocol: KV events and load reported after each step, pins
placed and removed on the router's word, full snapshots when the router asks. A mixin of
``EngineWorker``: everything here runs on the engine thread (the actor methods only enqueue).

A pin this worker does not hold yet is *copied* from a surviving holder when the router names
one (``PinOn.source``) and both workers have a transfer backend (P/D workers): the holder
exports the cached prefix (``EngineCore.export_prefix``: its blocks held for the copy, released on
this worker's notification or its release timeout), and this worker loads it as the decode side
of P/D loads a prefill's KV (one token past the prefix computed here). Without a holder, a
transfer backend, or when the holder no longer has it, the prefix is computed here."""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from actors.worker_types import _Tracked
from engine.routing import PinOn, WorkerLoad, WorkerSnapshot
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

LOAD_REPORT_INTERVAL_S = 0.05  # a changed load alone is reported at most this often
ROUTER_SYNC_TIMEOUT_S = 30.0
PIN_LOG_SIZE = 256  # the last pins placed here, with how and how fast (``pin_log``)


@dataclass
class _PinJob:
    """One pin being placed here: when the router's word came, how it is being made resident
    (``cached``, ``copy`` from a holder, ``compute``), and who waits for its end."""

    started: float
    method: str = "cached"
    source: str | None = None
    waiters: list[concurrent.futures.Future[dict[str, Any]]] = field(default_factory=list)


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

    async def _call(self, fn: Any, *args: Any) -> Any:
        raise NotImplementedError

    # -- router actions ----------------------------------------------------------------------------
    def pin(self, action: PinOn, source: Any = None) -> None:
        """Make ``action``'s prefix resident (copying it from ``source``, the actor handle of the
        holder ``action.source``, when given; else computing it), pin it, tell the router."""
        self._submit(self._pin_on, action, source, None)

    async def place_pin(self, action: PinOn, source: Any = None) -> dict[str, Any]:
        """``pin`` that answers when the pin is placed: ``{"pinned", "seconds", "method"}``
        (benchmarks and tests; the router itself never waits on a worker)."""
        import asyncio

        done: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._submit(self._pin_on, action, source, done)
        return await asyncio.wrap_future(done)

    async def export_prefix(self, request_id: str, token_ids: list[int]) -> Any:
        """Hold the cached prefix ``token_ids`` for a peer's copy; its ``KVHandle`` (or None)."""
        return await self._call(self.engine.export_prefix, request_id, token_ids)

    async def pin_log(self) -> list[dict[str, Any]]:
        """The last pins placed here: pin id, tokens pinned, method, source, seconds."""
        return list(self._pin_state()[1])

    def unpin(self, block_hashes: list[bytes], num_tokens: int) -> None:
        self._submit(self._unpin, block_hashes, num_tokens)

    def expect(self, block_hashes: list[bytes], num_tokens: int) -> None:
        """A request predicted to hit ``num_tokens`` cached tokens here was just routed here: keep
        those blocks the last to be evicted until it arrives (``EngineCore.refresh_prefix``)."""
        self._submit(self.engine.refresh_prefix, block_hashes, num_tokens)

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
        if self.engine.on_scheduled is None:  # also report what each scheduling evicted, at once
            self.engine.on_scheduled = self._report_scheduled
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
            except Exception as exc:  # noqa: BLE001 - the router is gone or slow: serve on, it resyncs later
                log.warning("%s: router report not acknowledged (%s)", self.worker_id, exc)

    def _report_scheduled(self) -> None:
        """Right after a step's scheduling: send its cache events (blocks it stored and evicted)
        before the forward runs, so routing during a long step sees the cache as it is."""
        self._report()

    def _update_gauges(self) -> None:
        assert self.metrics is not None
        gauges = self.engine.cache_gauges()
        self.metrics.set_cache_stats(gauges["free_blocks"], gauges["pinned_free_blocks"], gauges["hit_rate"])
        self.metrics.set_queue_stats(gauges["running"], gauges["waiting"])

    # -- pins --------------------------------------------------------------------------------------
    def _pin_state(self) -> tuple[dict[int, _PinJob], deque[dict[str, Any]]]:
        """(pins being placed, the log of placed ones), created on first use."""
        state = self.__dict__.get("_pins_placing")
        if state is None:
            state = self.__dict__["_pins_placing"] = ({}, deque(maxlen=PIN_LOG_SIZE))
        return state

    def _pin_on(self, action: PinOn, source: Any, done: concurrent.futures.Future[dict[str, Any]] | None) -> None:
        jobs, _ = self._pin_state()
        job = jobs.get(action.pin_id)
        if job is None:  # (a second PinOn of a pin in progress here joins the first's record)
            job = jobs[action.pin_id] = _PinJob(time.monotonic())
        if done is not None:
            job.waiters.append(done)
        have = self.engine.cached_prefix_tokens(action.block_hashes, action.num_tokens)
        if have >= action.num_tokens or not action.token_ids:
            self._finish_pin(action)
            return
        if source is not None and action.source is not None and self.engine.transfer is not None:
            job.method, job.source = "copy", str(action.source)
            copy_id = f"pin-{action.pin_id}-{uuid.uuid4().hex[:8]}"
            try:
                ref = source.export_prefix.remote(copy_id, list(action.token_ids))
            except Exception as exc:  # noqa: BLE001 - the holder's handle is unusable: compute here
                log.warning("%s: cannot ask %s for pin %d (%s); computing it", self.worker_id, action.source,
                            action.pin_id, exc)  # fmt: skip
            else:
                ref.future().add_done_callback(lambda f: self._submit(self._pin_copy, action, copy_id, f))
                return
        self._pin_compute(action)

    def _pin_copy(self, action: PinOn, copy_id: str, exported: concurrent.futures.Future[Any]) -> None:
        """The holder answered: load its handle like a prefill's KV, or compute without one."""
        try:
            handle = exported.result()
        except Exception as exc:  # noqa: BLE001 - the holder died or failed: compute here
            log.warning("%s: %s could not export pin %d (%s); computing it", self.worker_id, action.source,
                        action.pin_id, exc)  # fmt: skip
            handle = None
        if handle is None:
            self._pin_compute(action)
            return
        assert action.token_ids is not None
        tokens = list(action.token_ids) + [0]
        try:
            self.engine.add_request(copy_id, tokens, SamplingParams(max_tokens=1, ignore_eos=True), kv_handle=handle)
        except ValueError as exc:  # e.g. a handle that does not fit this engine: compute here
            log.warning("%s: cannot load pin %d from %s (%s); computing it", self.worker_id, action.pin_id,
                        action.source, exc)  # fmt: skip
            self._pin_compute(action)
            return
        self._tracked[copy_id] = _Tracked(None, None, len(tokens), pin=action)

    def _pin_compute(self, action: PinOn) -> None:
        # Compute the prefix here (+1 token: a request's hit search stops before its last token),
        # then pin it the moment the request finishes, before anything can evict it.
        jobs, _ = self._pin_state()
        job = jobs.get(action.pin_id)
        if job is not None:
            job.method = "compute"
        request_id = f"pin-{action.pin_id}-{uuid.uuid4().hex[:8]}"
        assert action.token_ids is not None
        tokens = list(action.token_ids) + [0]
        self.engine.add_request(request_id, tokens, SamplingParams(max_tokens=1, ignore_eos=True))
        self._tracked[request_id] = _Tracked(None, None, len(tokens), pin=action)

    def _finish_pin(self, action: PinOn) -> None:
        pinned = self.engine.pin_prefix(action.block_hashes, action.num_tokens)
        self._report(force=True)  # the pin's events reach the router before its result
        if self._router is not None:
            self._router.pin_result.remote(self.worker_id, action.pin_id, pinned, self.engine.event_seq)
        jobs, done_log = self._pin_state()
        job = jobs.pop(action.pin_id, None) or _PinJob(time.monotonic())
        record = {
            "pin_id": action.pin_id,
            "num_tokens": action.num_tokens,
            "pinned": pinned,
            "method": job.method,
            "source": job.source,
            "seconds": time.monotonic() - job.started,
        }
        done_log.append(record)
        for waiter in job.waiters:
            if not waiter.done():
                waiter.set_result(record)
        log.info("%s: pinned %d/%d tokens of pin %d (%s, %.3f s)", self.worker_id, pinned, action.num_tokens,
                 action.pin_id, job.method, record["seconds"])  # fmt: skip

    def _unpin(self, block_hashes: list[bytes], num_tokens: int) -> None:
        self.engine.unpin_prefix(block_hashes, num_tokens)
        self._report(force=True)

    def _snapshot(self) -> None:
        self._report(force=True)
        if self._router is not None:
            self._router.apply_snapshot.remote(self.worker_id, WorkerSnapshot(*self.engine.cache_snapshot()))
