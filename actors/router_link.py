"""A worker's side of the router protocol: KV events and load reported after each step (and right
after each scheduling), pins placed and removed on the router's word, full snapshots when the
router asks. ``EngineWorker`` owns one ``RouterLink``; every method here runs on the worker's
engine thread (the actor methods only enqueue).

A pin this worker does not hold yet is *copied* from a surviving holder when the router names
one (``PinOn.source``) and both workers have a transfer backend (P/D workers): the holder
exports the cached prefix (``EngineCore.export_prefix``: its blocks held for the copy, released on
this worker's notification or its release timeout), and this worker loads it as the decode side
of P/D loads a prefill's KV (one token past the prefix computed here). Without a holder, a
transfer backend, or when the holder no longer has it, the prefix is computed here."""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypedDict

from actors.worker_types import TrackedRequest
from engine.kv_cache.coordinator_types import PinTier
from engine.routing import PinOn, WorkerLoad, WorkerSnapshot
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import ray
    from ray.actor import ActorHandle

    from actors.metrics import WorkerMetrics
    from engine.core import EngineCore
    from engine.disagg import KVHandle
    from engine.kv_cache.events import KVEvent

log = logging.getLogger(__name__)

LOAD_REPORT_INTERVAL_S = 0.05  # a changed load alone is reported at most this often
PIN_LOG_SIZE = 256  # the last pins placed here, with how and how fast (``pin_log``)

PinMethod = Literal["cached", "copy", "compute"]


class PinRecord(TypedDict):
    """One pin placed here, as ``pin_log`` and ``EngineWorker.place_pin`` return it."""

    pin_id: int
    num_tokens: int
    pinned: int  # tokens actually pinned
    method: PinMethod
    source: str | None  # the holder it was copied from (``copy``)
    seconds: float  # from the router's word to the pin


@dataclass
class _PinJob:
    """One pin being placed here: when the router's word came, how it is being made resident
    (``cached``, ``copy`` from a holder, ``compute``), and who waits for its end."""

    started: float
    method: PinMethod = "cached"
    source: str | None = None
    waiters: list[concurrent.futures.Future[PinRecord]] = field(default_factory=list)


def pack_report(events: list[KVEvent], load: WorkerLoad) -> bytes:
    """A report's events and load as the one argument of ``Router.report``: pickled here by the
    standard library's C pickler, so Ray passes plain bytes instead of serializing each argument
    itself (its cloudpickle path, a fifth of the caller's CPU for the call, about 0.2 ms of the
    1 ms a report costs the worker's engine thread on this project's machine). The same trust as
    Ray's own arguments, which are pickles too."""
    return pickle.dumps((events, load), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_report(packed: bytes) -> tuple[list[KVEvent], WorkerLoad]:
    """``pack_report``'s events and load (the router's side)."""
    events, load = pickle.loads(packed)  # (a report from this cluster's own worker actor)
    return events, load


class RouterLink:
    """Owns this worker's connection to the router replicas (``router.replicas`` actors, each fed
    every report): their handles by replica, the last report sent to each (the refs are the ack
    a finished request carries), the last load reported and when, the pins being placed here and
    the log of placed ones.

    Runs a pin's prefix as a request of the worker's engine, registered through ``track`` in the
    worker's request table; the worker calls ``finish_pin`` when that request ends.
    ``run_on_engine_thread(fn, *args)`` enqueues ``fn`` on the engine thread (for callbacks
    that arrive on other threads).

    Invariants: nothing is sent to a replica before its ``connect``; a report carries every
    event the engine produced since the previous one (events are taken only here) and goes to
    every connected replica, so each sees them in order (a replica connected late sees a gap and
    asks for a snapshot); reports are numbered from 1 as sent, ``_applied`` is the number of the
    last one every replica it went to has answered (applied or failed) and ``_events_report`` the
    number and refs of the last one that carried events; a pin in ``_pins_placing`` ends in
    ``finish_pin`` exactly once, which answers all its waiters and tells the router.
    """

    def __init__(
        self,
        engine: EngineCore,
        worker_id: str,
        metrics: WorkerMetrics | None,
        run_on_engine_thread: Callable[..., object],
        track: Callable[[str, TrackedRequest], None],
        replicas: int = 1,
    ):
        self.engine = engine
        self.worker_id = worker_id
        self.metrics = metrics
        self._run_on_engine_thread = run_on_engine_thread
        self._track = track
        self._routers: list[ActorHandle | None] = [None] * replicas  # by replica
        self.last_report: tuple[ray.ObjectRef[None], ...] = ()  # the refs of the last report sent
        self._sent = 0  # reports sent, numbered from 1
        self._applied = 0  # the last report answered by every replica it went to (see ``ack``)
        self._events_report: tuple[int, tuple[ray.ObjectRef[None], ...]] = (0, ())
        self._applied_lock = threading.Lock()  # the answers arrive on Ray's threads
        self._last_load: WorkerLoad | None = None
        self._last_report_at = 0.0
        self._pins_placing: dict[int, _PinJob] = {}
        self._pin_log: deque[PinRecord] = deque(maxlen=PIN_LOG_SIZE)

    # -- reports to the router ---------------------------------------------------------------------
    def connect(self, router: ActorHandle, replica: int = 0) -> None:
        """Report to ``router`` (the Router actor of ``replica``) from now on, starting with the
        full load."""
        self._routers[replica] = router
        self.report(force=True)

    def _connected(self) -> list[ActorHandle]:
        return [router for router in self._routers if router is not None]

    def report(self, force: bool = False) -> None:
        """Send the router the engine's new KV events and its load: always when there are events
        or ``force``, else when the load changed and ``LOAD_REPORT_INTERVAL_S`` has passed."""
        routers = self._connected()
        if not routers:
            return
        events = self.engine.take_events()
        load = WorkerLoad(*self.engine.worker_view.load())
        now = time.monotonic()
        changed = load != self._last_load
        if events or force or (changed and now - self._last_report_at >= LOAD_REPORT_INTERVAL_S):
            self._send(routers, events, load, now)

    def ack(self) -> tuple[ray.ObjectRef[None], ...]:
        """What a request that finished in the last step waits for before it counts as finished
        (the ``router_ack`` of its last output): the refs of a report carrying every KV event so
        far. A new report when the engine has events not sent yet; else the refs of the last
        report that carried events while some replica has not answered it (reports apply in
        order, so that one covers every event sent before); else nothing (every replica holds
        every event already). A request whose blocks were all cached before it ran (a full
        prefix hit) so costs no router call, and no wait for one."""
        routers = self._connected()
        if not routers:
            return ()
        events = self.engine.take_events()
        if events:
            self._send(routers, events, WorkerLoad(*self.engine.worker_view.load()), time.monotonic())
            return self.last_report
        number, refs = self._events_report
        with self._applied_lock:
            return () if self._applied >= number else refs

    def _send(self, routers: list[ActorHandle], events: list[KVEvent], load: WorkerLoad, now: float) -> None:
        """One report to every connected replica; ``_applied`` follows once all of them answered."""
        packed = pack_report(events, load)
        refs: tuple[ray.ObjectRef[None], ...] = tuple(
            router.report.remote(self.worker_id, packed) for router in routers
        )
        self.last_report = refs
        self._sent += 1
        number, waiting = self._sent, [len(refs)]
        if events:
            self._events_report = (number, refs)

        def answered(_: concurrent.futures.Future[None]) -> None:
            with self._applied_lock:
                waiting[0] -= 1
                if waiting[0] == 0:
                    self._applied = max(self._applied, number)

        for ref in refs:
            ref.future().add_done_callback(answered)
        self._last_load, self._last_report_at = load, now
        if self.metrics is not None:
            self._update_gauges(self.metrics)

    def report_scheduled(self) -> None:
        """Right after a step's scheduling: send its cache events (blocks it stored and evicted)
        before the forward runs, so routing during a long step sees the cache as it is."""
        self.report()

    def send_snapshot(self, replica: int | None = None) -> None:
        """Send the router replica ``replica`` (None: every one) a full snapshot of the prefix
        cache (it lost events)."""
        self.report(force=True)
        routers = self._connected() if replica is None else [r for r in self._routers[replica : replica + 1] if r]
        if routers:
            snapshot = WorkerSnapshot(*self.engine.worker_view.cache_snapshot())
            for router in routers:
                router.apply_snapshot.remote(self.worker_id, snapshot)

    def _update_gauges(self, metrics: WorkerMetrics) -> None:
        gauges = self.engine.worker_view.cache_gauges()
        metrics.set_cache_stats(int(gauges["free_blocks"]), int(gauges["pinned_free_blocks"]), gauges["hit_rate"])
        metrics.set_queue_stats(int(gauges["running"]), int(gauges["waiting"]))

    # -- pins --------------------------------------------------------------------------------------
    def pin_log(self) -> list[PinRecord]:
        """The last pins placed here, oldest first."""
        return list(self._pin_log)

    def place_pin(
        self, action: PinOn, source: ActorHandle | None, done: concurrent.futures.Future[PinRecord] | None
    ) -> None:
        """Make ``action``'s prefix resident (copied from ``source``, the holder's actor handle,
        when given and both sides can transfer; else computed here) and pin it; ``done`` gets
        the pin's record."""
        job = self._pins_placing.get(action.pin_id)
        if job is None:  # (a second PinOn of a pin in progress here joins the first's record)
            job = self._pins_placing[action.pin_id] = _PinJob(time.monotonic())
        if done is not None:
            job.waiters.append(done)
        have = self.engine.worker_view.cached_prefix_tokens(action.block_hashes, action.num_tokens)
        if have >= action.num_tokens or not action.token_ids:
            self.finish_pin(action)
            return
        if source is not None and action.source is not None and self.engine.transfer is not None:
            job.method, job.source = "copy", str(action.source)
            copy_id = f"pin-{action.pin_id}-{uuid.uuid4().hex[:8]}"
            try:
                ref: ray.ObjectRef[KVHandle | None] = source.export_prefix.remote(copy_id, list(action.token_ids))
            except Exception as exc:  # noqa: BLE001 - the holder's handle is unusable: compute here
                log.warning(
                    "%s: cannot ask %s for pin %d (%s); computing it", self.worker_id, action.source, action.pin_id, exc
                )
            else:
                ref.future().add_done_callback(
                    lambda exported: self._run_on_engine_thread(self._pin_copy, action, copy_id, exported)
                )
                return
        self._pin_compute(action)

    def _pin_copy(self, action: PinOn, copy_id: str, exported: concurrent.futures.Future[KVHandle | None]) -> None:
        """The holder answered: load its handle like a prefill's KV, or compute without one."""
        try:
            handle = exported.result()
        except Exception as exc:  # noqa: BLE001 - the holder died or failed: compute here
            log.warning(
                "%s: %s could not export pin %d (%s); computing it", self.worker_id, action.source, action.pin_id, exc
            )
            handle = None
        if handle is None:
            self._pin_compute(action)
            return
        assert action.token_ids is not None
        tokens = [*action.token_ids, 0]
        try:
            self.engine.add_request(copy_id, tokens, SamplingParams(max_tokens=1, ignore_eos=True), kv_handle=handle)
        except ValueError as exc:  # e.g. a handle that does not fit this engine: compute here
            log.warning(
                "%s: cannot load pin %d from %s (%s); computing it", self.worker_id, action.pin_id, action.source, exc
            )
            self._pin_compute(action)
            return
        self._track(copy_id, TrackedRequest(None, None, len(tokens), pin=action))

    def _pin_compute(self, action: PinOn) -> None:
        # Compute the prefix here (+1 token: a request's hit search stops before its last token),
        # then pin it the moment the request finishes, before anything can evict it.
        job = self._pins_placing.get(action.pin_id)
        if job is not None:
            job.method = "compute"
        request_id = f"pin-{action.pin_id}-{uuid.uuid4().hex[:8]}"
        assert action.token_ids is not None
        tokens = [*action.token_ids, 0]
        self.engine.add_request(request_id, tokens, SamplingParams(max_tokens=1, ignore_eos=True))
        self._track(request_id, TrackedRequest(None, None, len(tokens), pin=action))

    def finish_pin(self, action: PinOn) -> None:
        """The prefix is resident (its request ended, or it was cached already): pin it, report,
        tell the router the result and answer the pin's waiters."""
        pinned = self.engine.worker_view.pin_prefix(action.block_hashes, action.num_tokens, action.tier)
        self.report(force=True)  # the pin's events reach the router before its result
        for router in self._connected():  # the replica that decides pins takes it, the others ignore it
            router.pin_result.remote(self.worker_id, action.pin_id, pinned, self.engine.worker_view.event_seq)
        job = self._pins_placing.pop(action.pin_id, None) or _PinJob(time.monotonic())
        record = PinRecord(
            pin_id=action.pin_id,
            num_tokens=action.num_tokens,
            pinned=pinned,
            method=job.method,
            source=job.source,
            seconds=time.monotonic() - job.started,
        )
        self._pin_log.append(record)
        for waiter in job.waiters:
            if not waiter.done():
                waiter.set_result(record)
        log.info(
            "%s: pinned %d/%d tokens of pin %d (%s, %.3f s)",
            self.worker_id,
            pinned,
            action.num_tokens,
            action.pin_id,
            job.method,
            record["seconds"],
        )

    def unpin(self, block_hashes: list[bytes], num_tokens: int, tier: PinTier = "device") -> None:
        """Release the pin on this prefix in ``tier`` (the router's word) and report at once."""
        self.engine.worker_view.unpin_prefix(block_hashes, num_tokens, tier)
        self.report(force=True)
