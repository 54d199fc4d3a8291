"""A request's path through a worker's engine thread: intake (``_add``; a handle's delivery,
early or on time; aborts, tombstones and leases) and replies (each step's outputs turned into
stream chunks or a prefill's result, every request answered exactly once).

A mixin of ``EngineWorker``: everything here runs on the engine thread (the actor methods only
enqueue); results reach the actor's event loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from actors.hops import prefill_hops, token_hops
from actors.worker_types import PrefillResult, TokenChunk, _Tracked
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestOutput

log = logging.getLogger(__name__)

REMOTE_DECODE = "remote_decode"
MAX_TOMBSTONES = 10_000
EARLY_HANDLE_WAIT_S = 5.0  # a handle that arrived before its request waits this long for it


class WorkerRequests:
    """Intake and replies of the requests on one worker (state lives in ``EngineWorker``:
    ``engine``, ``_tracked``, ``_tombstones``, ``_early_handles``, ``_leases``, ``metrics``).

    Invariants: a driver's request is in ``_tracked`` (with a lease in ``_leases``) from ``_add``
    until ``_answer`` delivers its one final result (a pin's request ends in ``_finish_pin``); an
    id in ``_tombstones`` was aborted before it arrived and ends at once when it does; a handle
    in ``_early_handles`` is delivered to its request or, after ``EARLY_HANDLE_WAIT_S``, discarded
    (its owner notified).
    """

    engine: Any
    worker_id: str
    config: Any
    metrics: Any
    _tracked: dict[str, _Tracked]
    _tombstones: OrderedDict[str, None]
    _early_handles: dict[str, tuple[Any, float]]
    _leases: dict[str, float]
    _last_report: Any
    _report: Any
    _finish_pin: Any

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        tracked: _Tracked,
        kv_handle: Any = None,
        prefill_only: bool = False,
        expect_handle: bool = False,
        peer: Any = None,
    ) -> None:
        if request_id in self._tracked:
            raise ValueError(f"request_id: {request_id!r} is already running on {self.worker_id}")
        if self._tombstones.pop(request_id, 0) is None:  # its abort overtook it: end it at once
            self._tracked[request_id] = tracked
            self._answer(request_id, TokenChunk([], True, "abort"))
            early = self._early_handles.pop(request_id, None)
            if early is not None:
                self.engine.discard_handle(early[0])
            return
        engine = self.engine
        if expect_handle:
            tracked.request = engine.expect_remote_prefill(request_id, prompt_token_ids, sampling, peer)
            if engine.is_reserved(request_id):
                tracked.reserved_at = time.monotonic()
        else:
            tracked.request = engine.add_request(request_id, prompt_token_ids, sampling, prefill_only=prefill_only,
                                                 kv_handle=kv_handle)  # fmt: skip
        self._tracked[request_id] = tracked
        self._leases[request_id] = time.monotonic()
        early = self._early_handles.pop(request_id, None)
        if early is not None:
            self._deliver(request_id, *early)

    def _deliver(self, request_id: str, kv_handle: Any, received: float) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            if request_id in self._tombstones:  # aborted before it arrived: nobody reads it
                self.engine.discard_handle(kv_handle)
            else:  # its generate call has not run yet (or the request ended here already)
                self._early_handles[request_id] = (kv_handle, received)
            return
        tracked.handle_at, tracked.handle_taken_at = received, time.monotonic()
        failed = self.engine.provide_handle(request_id, kv_handle)
        if failed is not None:
            self._dispatch([failed])

    def _expire_leases(self, now: float) -> None:
        """Abort the requests no driver renewed within ``workers.request_lease_s``; let the
        owners of handles no request here claimed free their blocks."""
        for request_id, (handle, received) in list(self._early_handles.items()):
            if now - received > EARLY_HANDLE_WAIT_S:
                del self._early_handles[request_id]
                self.engine.discard_handle(handle)
        lease_s = self.config.workers.request_lease_s
        for request_id, renewed in list(self._leases.items()):
            if now - renewed > lease_s:
                log.warning("%s: %s not renewed for %.0f s (its driver or client is gone); aborting it",
                            self.worker_id, request_id, now - renewed)  # fmt: skip
                self._leases.pop(request_id, None)
                self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        found = self.engine.abort(request_id)
        if request_id in self._tracked:
            found = True
            if self.metrics is not None:
                self.metrics.record_request_aborted()
            self._answer(request_id, TokenChunk([], True, "abort"))
        elif not found:  # not here (yet): if it arrives later, it ends at once
            self._tombstones[request_id] = None
            if len(self._tombstones) > MAX_TOMBSTONES:
                self._tombstones.popitem(last=False)
        return found

    def _abort_all(self) -> None:
        for request_id in list(self._tracked):
            self._abort(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        ack = None
        if any(out.finished for out in outputs):
            self._report(force=True)  # sent, not awaited: the driver awaits ``ack`` instead
            ack = self._last_report
        now = time.monotonic()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            if out.num_cached_tokens >= 0:
                tracked.cached_tokens = out.num_cached_tokens
            hops = None
            if out.new_token_ids:
                if tracked.first_token is None:
                    tracked.first_token = now
                    hops = token_hops(tracked, now)
                tracked.output_tokens += len(out.new_token_ids)
            if out.finish_reason == REMOTE_DECODE:
                result = PrefillResult(out.kv_handle, tracked.cached_tokens, REMOTE_DECODE,
                                       hops=prefill_hops(tracked, now), router_ack=ack)  # fmt: skip
                self._answer(out.request_id, result)
            elif out.finished:
                self._finished(out, tracked, now, hops, ack)
            elif tracked.sink is not None:
                self._put(tracked, TokenChunk(list(out.new_token_ids), False, None, tracked.cached_tokens, hops=hops))

    def _finished(
        self, out: RequestOutput, tracked: _Tracked, now: float, hops: dict[str, float] | None = None, ack: Any = None
    ) -> None:
        if self.metrics is not None and out.finish_reason not in ("abort", "error"):
            self.metrics.record_request_finished(
                (tracked.first_token or now) - tracked.arrival,
                tracked.prompt_tokens,
                tracked.output_tokens,
                cached_tokens=max(0, min(tracked.cached_tokens, tracked.prompt_tokens)),
            )
        if tracked.pin is not None:
            del self._tracked[out.request_id]
            self._finish_pin(tracked.pin)
            return
        chunk = TokenChunk(list(out.new_token_ids), True, out.finish_reason, tracked.cached_tokens, error=out.error,
                           hops=hops, router_ack=ack)  # fmt: skip
        self._answer(out.request_id, chunk)

    def _answer(self, request_id: str, result: TokenChunk | PrefillResult) -> None:
        """Deliver a request's final result and forget it."""
        tracked = self._tracked.pop(request_id, None)
        self._leases.pop(request_id, None)
        if tracked is None or tracked.sink is None:
            return
        if isinstance(tracked.sink, asyncio.Queue):
            if isinstance(result, PrefillResult):
                result = TokenChunk([], True, result.finish_reason, error=result.error,
                                    worker_failed=result.worker_failed)  # fmt: skip
            self._put(tracked, result)
            return
        if isinstance(result, TokenChunk):  # a prefill that ended without a handle
            result = PrefillResult(None, tracked.cached_tokens, result.finish_reason or "abort", result.error,
                                   result.worker_failed)  # fmt: skip
        future = tracked.sink
        assert tracked.loop is not None
        tracked.loop.call_soon_threadsafe(_resolve, future, result)

    @staticmethod
    def _put(tracked: _Tracked, chunk: TokenChunk) -> None:
        assert tracked.loop is not None and isinstance(tracked.sink, asyncio.Queue)
        tracked.loop.call_soon_threadsafe(tracked.sink.put_nowait, chunk)


def _resolve(future: asyncio.Future[PrefillResult], result: PrefillResult) -> None:
    if not future.done():
        future.set_result(result)
