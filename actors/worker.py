"""Prefill and decode worker actors: one EngineCore each, stepped by a background thread.

The actor is an asyncio actor, so it keeps accepting calls (new requests, aborts, pins, stats)
while the engine computes. Every engine access happens on the engine thread: actor methods
enqueue a command and await its result. Tokens stream back per request through a Ray streaming
generator (``generate``); a prefill-only request resolves to its ``KVHandle`` (``prefill``).

A request whose whole output is one chunk (one token: ``max_tokens`` 1) may be run with
``complete`` instead: the same request answered by one plain call, which costs a driver less
than a stream (one reply instead of an item report and the stream's end).

After each step the thread reports the engine's KV events and load to the router actor; it
never waits for the router. A finished request's last output (the final chunk, or a prefill's
result) carries the ref of the report that holds its blocks (``router_ack``): the driver awaits
it before it calls the request finished, so a request routed after another finished sees that
request's cached blocks, and the engine loop never blocks on the router. When every event was
sent already (a request whose blocks were all cached) no report is sent for it: it carries the
last report's ref, or nothing once every router replica answered that one (``RouterLink.ack``).

P/D on the decode side: ``generate(..., expect_handle=True, peer=...)`` is called as soon as the
request is routed, while the prefill worker computes it: the engine reserves the prompt's blocks
and warms the connection to ``peer``; ``deliver`` brings the handle and the read starts at once.
A handle that overtakes its ``generate`` waits here up to ``EARLY_HANDLE_WAIT_S``; one whose
request ended is answered with a notification only (its owner frees at once).

Hops: each request's timings on this worker's monotonic clock travel as durations (``hops`` of
the first tokens' chunk or of the prefill result); the driver assembles the breakdown.

Health: a request whose step fails ends alone with ``finish_reason="error"`` and its reason (the
engine isolates it); an engine that cannot go on stops its thread, and from then on every call
raises ``WorkerUnavailableError`` and every open stream ends with ``worker_failed`` set, so
drivers treat the worker like a dead actor. ``health`` also renews the lease of the requests a
driver still waits on: a request whose lease runs out (its driver or client is gone) is aborted.

The router protocol (reports after each step and each scheduling, pins, snapshots) is the
``RouterLink`` the worker owns (``actors.router_link``).

No policy lives here: the router decides placement and pins; this only executes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, Literal

import ray

from actors.hops import prefill_hops, token_hops
from actors.metrics import WorkerMetrics
from actors.router_link import PinRecord, RouterLink
from actors.worker_types import (
    STALE_PREDICTION,
    ExpectedHit,
    PrefillResult,
    TokenChunk,
    TrackedRequest,
    WorkerInfo,
    WorkerRole,
    WorkerUnavailableError,
)
from configs.schema import ClusterConfig
from engine.kv_cache.coordinator_types import PinTier
from engine.request import RequestStatus
from engine.routing import PinOn
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestOutput

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from engine.core import EngineCore
    from engine.disagg import KVHandle
    from engine.transfer import AgentInfo

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # nothing to do: wait this long for a command
TRANSFER_WAIT_S = 0.002  # only transfers in flight / blocks held: poll this often
LEASE_SWEEP_INTERVAL_S = 1.0  # how often the engine thread looks for requests whose lease ran out
EARLY_HANDLE_WAIT_S = 5.0  # a handle that arrived before its request waits this long for it
MAX_TOMBSTONES = 10_000  # ids aborted before they arrived, remembered (oldest forgotten first)
REMOTE_DECODE = RequestStatus.FINISHED_REMOTE_DECODE.value  # a prefill-only request ended: its KV awaits a reader


class EngineWorker:
    """Owns one EngineCore, the thread that steps it, the requests it runs for drivers and the
    ``RouterLink`` that reports to the router; the body of both worker actors.

    Invariants: only the engine thread touches ``self.engine`` (actor methods enqueue commands);
    a driver's request is in ``_tracked`` (with a lease in ``_leases``) from ``_add`` until
    ``_answer`` delivers its one final result, so its stream receives exactly one ``finished``
    chunk (a pin's request ends in ``RouterLink.finish_pin`` instead); an id in ``_tombstones``
    was aborted before it arrived and ends at once when it does; a handle in ``_early_handles``
    is delivered to its request or, after ``EARLY_HANDLE_WAIT_S``, discarded (its owner
    notified).
    """

    role: WorkerRole = "decode"

    def __init__(self, config: ClusterConfig, worker_id: str, disaggregated: bool, rank_address: str | None = None):
        """``rank_address``: with ``workers.tensor_parallel_size`` > 1, where this worker's ranks
        meet (``tcp://host:port``, cluster/rank_groups.py); this actor is rank 0 and leads them."""
        from configs.logs import setup_logging
        from engine.core import EngineCore
        from engine.rank_group import RankLeader, join_rank_group, lead_ranks

        setup_logging(config.logging)
        self.config = config
        self.worker_id = worker_id
        workers = config.workers
        resources = workers.prefill if self.role == "prefill" else workers.decode
        kv_role = self.role if disaggregated else None
        self.router_role: Literal["prefill", "decode", "both"] = self.role if disaggregated else "both"
        if workers.tensor_parallel_size > 1:
            assert rank_address is not None, "a split worker's ranks meet at the address its group was given"
            size = workers.tensor_parallel_size
            join_rank_group(rank_address, 0, size, config.model.device, workers.engine_stall_timeout_s)
        self.engine: EngineCore = EngineCore(config, threads=resources.num_threads, name=worker_id, kv_role=kv_role)
        #: the other ranks' channel (None on one rank): every step goes to them before it runs
        self.rank_leader: RankLeader | None = (
            lead_ranks(self.engine.runner, self.engine.handoff) if workers.tensor_parallel_size > 1 else None
        )
        self._commands: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]]
        self._commands = queue.SimpleQueue()
        self._tracked: dict[str, TrackedRequest] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()  # aborted before they arrived
        self._early_handles: dict[str, tuple[KVHandle, float]] = {}  # handles that overtook their request
        self._stopped = False
        self._error: str | None = None
        self._steps = 0
        self._leases: dict[str, float] = {}  # request id -> when its driver last renewed it
        self._last_loop = time.monotonic()  # when the engine thread last came round its loop
        self._last_sweep = 0.0
        self.metrics = _worker_metrics(worker_id, self.role)
        self.router_link = RouterLink(
            self.engine, worker_id, self.metrics, self._submit, self._tracked.__setitem__, config.router.replicas
        )
        # Each scheduling's cache events (blocks stored and evicted) reach the router before the
        # forward runs; nothing is sent until ``set_router`` connects the link.
        self.engine.on_scheduled = self.router_link.report_scheduled
        self._thread = threading.Thread(target=self._loop, name=f"engine-{worker_id}", daemon=True)
        self._thread.start()

    # -- lifecycle ---------------------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        engine = self.engine
        return WorkerInfo(
            self.worker_id,
            self.role,
            self.router_role,
            engine.info.num_blocks - 1,
            engine.info.block_size,
            engine.info.max_model_len,
            engine.info.arch.vocab_size,
            tuple(engine.worker_view.kv_groups),
            str(engine.model_directory),
            _node_ip(),
            os.getpid(),
            engine.agent_info if engine.transfer is not None else None,
            eos_token_id=engine.eos_token_id,
        )

    async def set_router(self, router: ActorHandle, replica: int = 0) -> None:
        """Start reporting KV events and load to ``router`` (the Router actor of ``replica``)."""
        await self._call(self.router_link.connect, router, replica)

    async def health(self, renew: list[str] | None = None) -> dict[str, str | int]:
        """Liveness of the engine thread; raises ``WorkerUnavailableError`` if it stopped or has
        not come round its loop for ``workers.engine_stall_timeout_s``. ``renew``: ids of the
        requests the caller still waits on (their leases start again)."""
        self._check_alive()
        stalled = time.monotonic() - self._last_loop
        if stalled > self.config.workers.engine_stall_timeout_s:
            raise WorkerUnavailableError(f"{self.worker_id}: engine thread stalled for {stalled:.0f} s")
        if renew:
            now = time.monotonic()
            leases = self._leases
            for request_id in renew:
                if request_id in leases:
                    leases[request_id] = now
        return {"worker_id": self.worker_id, "steps": self._steps, "requests": len(self._tracked)}

    def _check_alive(self) -> None:
        if self._error:
            raise WorkerUnavailableError(f"{self.worker_id}: engine stopped ({self._error})")
        if self._stopped or not self._thread.is_alive():
            raise WorkerUnavailableError(f"{self.worker_id}: worker is shut down")

    async def shutdown(self) -> None:
        """Abort everything, stop the engine thread and release the transfer registration."""
        if self._stopped:
            return
        try:
            await self._call(self._abort_all)
        finally:
            self._stopped = True
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
            self.engine.close()
            if self.rank_leader is not None and self._error is None:
                self.rank_leader.stop()

    # -- requests ----------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_handle: KVHandle | None = None,
        expect_handle: bool = False,
        peer: AgentInfo | None = None,
        cache_salt: str | None = None,
        output_token_ids: tuple[int, ...] = (),
        expected: ExpectedHit | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Run a request to the end here (pulling its prompt's KV first when given a handle);
        yields a ``TokenChunk`` whenever tokens arrive, the last one with ``finished=True``.
        ``expect_handle``: a prefill worker (transfer agent ``peer``) is computing the prompt's
        KV now; reserve its blocks and wait for the handle (``deliver``). ``output_token_ids``:
        the tokens the request already generated on a worker that was lost (a migration): it
        goes on after them (``EngineCore.add_request``), run whole here. ``expected``: the prompt's
        block hashes and the hit the router predicted here (``expect``, done on arrival). The
        driver checked the request at its entry point (token ids, length, sampling, ``cache_salt``).
        Leaving early aborts the request."""
        assert not (output_token_ids and (expect_handle or kv_handle is not None)), "a migrated request runs whole"
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()
        tracked = TrackedRequest(loop, chunks, len(prompt_token_ids))
        await self._call(
            self._add,
            request_id,
            prompt_token_ids,
            sampling,
            tracked,
            kv_handle,
            False,
            expect_handle,
            peer,
            cache_salt,
            output_token_ids,
            expected,
        )
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                while not chunks.empty() and not chunk.finished:  # coalesce what piled up
                    chunk = chunk.followed_by(chunks.get_nowait())
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:  # the consumer went away (cancelled, or the driver died)
                self._submit(self._abort, request_id)

    async def complete(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_handle: KVHandle | None = None,
        expect_handle: bool = False,
        peer: AgentInfo | None = None,
        cache_salt: str | None = None,
        output_token_ids: tuple[int, ...] = (),
        expected: ExpectedHit | None = None,
    ) -> TokenChunk:
        """``generate`` answered in one reply: every chunk of the request as one, finished (for a
        request whose output is one chunk anyway, such as a one-token one, a plain call costs
        less than a stream). Cancelling the call aborts the request, as leaving the stream does."""
        chunks = self.generate(
            request_id,
            prompt_token_ids,
            sampling,
            kv_handle,
            expect_handle,
            peer,
            cache_salt,
            output_token_ids,
            expected,
        )
        whole: TokenChunk | None = None
        try:
            async for chunk in chunks:
                whole = chunk if whole is None else whole.followed_by(chunk)
        finally:
            await chunks.aclose()
        assert whole is not None and whole.finished, "a request's chunks end with a finished one"
        return whole

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        cache_salt: str | None = None,
        expected: ExpectedHit | None = None,
    ) -> PrefillResult:
        """Compute the KV of the prompt's first N - 1 tokens for a decode worker to pull (hashed
        with ``cache_salt``, as the decode worker hashes them); ``expected`` as for ``generate``."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[PrefillResult] = loop.create_future()
        tracked = TrackedRequest(loop, done, len(prompt_token_ids))
        await self._call(
            self._add,
            request_id,
            prompt_token_ids,
            SamplingParams(max_tokens=1),
            tracked,
            None,
            True,
            False,
            None,
            cache_salt,
            (),
            expected,
        )
        try:
            return await done
        except asyncio.CancelledError:
            self._submit(self._abort, request_id)
            raise

    async def deliver(self, request_id: str, kv_handle: KVHandle) -> None:
        """The handle of a request announced with ``expect_handle``: start reading its KV."""
        await self._call(self._deliver, request_id, kv_handle, time.monotonic())

    async def warm_peers(self, agents: list[AgentInfo]) -> int:
        """Open the transfer connection to each of these prefill workers' agents now (so their
        first reads pay no setup); returns how many were new."""
        return int(await self._call(lambda: sum(self.engine.warm_peer(agent) for agent in agents)))

    async def abort(self, request_id: str) -> bool:
        """Stop a request here and free its blocks; its stream ends with ``finish_reason="abort"``."""
        return bool(await self._call(self._abort, request_id))

    async def stats(self) -> dict[str, Any]:
        """The engine's counters plus this worker's identity and hit rate (plain data)."""
        stats = await self._call(self.engine.worker_view.stats)
        stats.update(worker_id=self.worker_id, role=self.role, requests=len(self._tracked))
        queried = stats["queried_tokens"]
        stats["hit_rate"] = stats["hit_tokens"] / queried if queried else 0.0
        stats["metrics"] = self.metrics.snapshot() if self.metrics is not None else {}
        return stats

    # -- router actions (the router calls these without waiting) ----------------------------------
    def pin(self, action: PinOn, source: ActorHandle | None = None) -> None:
        """Make ``action``'s prefix resident (copying it from ``source``, the actor handle of the
        holder ``action.source``, when given; else computing it), pin it, tell the router."""
        self._submit(self.router_link.place_pin, action, source, None)

    async def place_pin(self, action: PinOn, source: ActorHandle | None = None) -> PinRecord:
        """``pin`` that answers when the pin is placed: its ``PinRecord`` (``pinned``,
        ``seconds``, ``method``, ...; benchmarks and tests: the router itself never waits on a
        worker)."""
        done: concurrent.futures.Future[PinRecord] = concurrent.futures.Future()
        self._submit(self.router_link.place_pin, action, source, done)
        return await asyncio.wrap_future(done)

    async def export_prefix(self, request_id: str, token_ids: list[int]) -> KVHandle | None:
        """Hold the cached prefix ``token_ids`` for a peer's copy; its ``KVHandle`` (or None)."""
        handle: KVHandle | None = await self._call(self.engine.export_prefix, request_id, token_ids)
        return handle

    async def pin_log(self) -> list[PinRecord]:
        """The last pins placed here: pin id, tokens pinned, method, source, seconds."""
        return self.router_link.pin_log()

    def unpin(self, block_hashes: list[bytes], num_tokens: int, tier: PinTier = "device") -> None:
        self._submit(self.router_link.unpin, block_hashes, num_tokens, tier)

    def snapshot(self, replica: int | None = None) -> None:
        """Send router replica ``replica`` (None: every one) a full snapshot of the prefix cache
        (it lost events)."""
        self._submit(self.router_link.send_snapshot, replica)

    # -- engine thread -----------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            self._check_alive()
        except WorkerUnavailableError as exc:
            future.set_exception(exc)
        else:
            self._commands.put((fn, args, future))
        return future

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopped:
                self._last_loop = now = time.monotonic()
                if now - self._last_sweep >= LEASE_SWEEP_INTERVAL_S:
                    self._last_sweep = now
                    self._expire_leases(now)
                if engine.has_compute_work:
                    wait = 0.0
                else:
                    busy = engine.has_work and not engine.only_awaiting_handles  # a handle comes as a call
                    wait = TRANSFER_WAIT_S if busy else IDLE_WAIT_S
                self._run_commands(wait)
                if engine.has_work:
                    outputs = engine.step()
                    self._steps += 1
                    self._record_transfers()
                    if outputs:
                        self._dispatch(outputs)
                self.router_link.report()
                if self.rank_leader is not None:
                    self.rank_leader.keepalive(now)
        except BaseException as exc:  # a broken engine: fail every request, stay inspectable
            self._error = f"{type(exc).__name__}: {exc}"
            log.exception("%s: engine loop failed; the worker is unhealthy from now on", self.worker_id)
            why = f"{self.worker_id}: engine stopped ({self._error})"
            for request_id in list(self._tracked):
                self._answer(request_id, TokenChunk([], True, "error", error=why, worker_failed=True))
            while True:  # fail commands queued behind the crash
                try:
                    _, _, future = self._commands.get_nowait()
                except queue.Empty:
                    break
                future.set_exception(WorkerUnavailableError(why))

    def _record_transfers(self) -> None:
        """Count the KV reads the last step finished in this worker's transfer series."""
        reads = self.engine.worker_view.take_completed_reads()
        if self.metrics is not None:
            for read in reads:
                self.metrics.record_transfer(read.nbytes, read.seconds)

    def _run_commands(self, wait: float) -> None:
        try:
            command = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, args, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - errors go back to the caller, the loop goes on
                    future.set_exception(exc)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    # -- a request's path on the engine thread: intake, handles, aborts, leases, replies -----------
    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        tracked: TrackedRequest,
        kv_handle: KVHandle | None = None,
        prefill_only: bool = False,
        expect_handle: bool = False,
        peer: AgentInfo | None = None,
        cache_salt: str | None = None,
        output_token_ids: tuple[int, ...] = (),
        expected: ExpectedHit | None = None,
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
        if expected is not None:  # the router's predicted hit, held here until the request is admitted
            held = engine.worker_view.lease_prefix(request_id, expected.block_hashes, expected.num_tokens)
            if held < expected.num_tokens and expected.strict:  # evicted before the router knew: route again
                engine.worker_view.release_lease(request_id)
                self._tracked[request_id] = tracked
                self._answer(request_id, PrefillResult(None, held, STALE_PREDICTION, router_ack=self.router_link.ack()))
                return
        try:
            if expect_handle:
                tracked.request = engine.expect_remote_prefill(
                    request_id, prompt_token_ids, sampling, peer, cache_salt=cache_salt
                )
                if engine.worker_view.is_reserved(request_id):
                    tracked.reserved_at = time.monotonic()
            elif output_token_ids:  # a migrated request goes on after the tokens it generated elsewhere
                tracked.request = engine.add_request(
                    request_id, prompt_token_ids, sampling, cache_salt=cache_salt, output_token_ids=output_token_ids
                )
            else:
                tracked.request = engine.add_request(
                    request_id,
                    prompt_token_ids,
                    sampling,
                    prefill_only=prefill_only,
                    kv_handle=kv_handle,
                    cache_salt=cache_salt,
                )
        except BaseException:
            engine.worker_view.release_lease(request_id)  # a request refused here holds nothing
            raise
        self._tracked[request_id] = tracked
        self._leases[request_id] = time.monotonic()
        early = self._early_handles.pop(request_id, None)
        if early is not None:
            self._deliver(request_id, *early)

    def _deliver(self, request_id: str, kv_handle: KVHandle, received: float) -> None:
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
                log.warning(
                    "%s: %s not renewed for %.0f s (its driver or client is gone); aborting it",
                    self.worker_id,
                    request_id,
                    now - renewed,
                )
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
        ack: tuple[ray.ObjectRef[None], ...] = ()
        if any(out.finished for out in outputs):
            ack = self.router_link.ack()  # a report sent (never awaited here) if it has events to carry
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
                result = PrefillResult(
                    out.kv_handle, tracked.cached_tokens, REMOTE_DECODE, hops=prefill_hops(tracked, now), router_ack=ack
                )
                self._answer(out.request_id, result)
            elif out.finished:
                self._finished(out, tracked, now, hops, ack)
            elif tracked.sink is not None:
                self._put(
                    tracked,
                    TokenChunk(
                        list(out.new_token_ids),
                        False,
                        None,
                        tracked.cached_tokens,
                        hops=hops,
                        logprobs=out.logprobs,
                        prompt_logprobs=out.prompt_logprobs,
                    ),
                )

    def _finished(
        self,
        out: RequestOutput,
        tracked: TrackedRequest,
        now: float,
        hops: dict[str, float] | None = None,
        ack: tuple[ray.ObjectRef[None], ...] = (),
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
            self.router_link.finish_pin(tracked.pin)
            return
        chunk = TokenChunk(
            list(out.new_token_ids),
            True,
            out.finish_reason,
            tracked.cached_tokens,
            error=out.error,
            hops=hops,
            router_ack=ack,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )
        self._answer(out.request_id, chunk)

    def _answer(self, request_id: str, result: TokenChunk | PrefillResult) -> None:
        """Deliver a request's final result and forget it."""
        tracked = self._tracked.pop(request_id, None)
        self._leases.pop(request_id, None)
        if tracked is None or tracked.sink is None:
            return
        if isinstance(tracked.sink, asyncio.Queue):
            if isinstance(result, PrefillResult):
                result = TokenChunk(
                    [],
                    True,
                    result.finish_reason,
                    error=result.error,
                    worker_failed=result.worker_failed,
                    router_ack=result.router_ack,
                )
            self._put(tracked, result)
            return
        if isinstance(result, TokenChunk):  # a prefill that ended without a handle
            result = PrefillResult(
                None, tracked.cached_tokens, result.finish_reason or "abort", result.error, result.worker_failed
            )
        future = tracked.sink
        assert tracked.loop is not None
        tracked.loop.call_soon_threadsafe(_resolve, future, result)

    @staticmethod
    def _put(tracked: TrackedRequest, chunk: TokenChunk) -> None:
        assert tracked.loop is not None and isinstance(tracked.sink, asyncio.Queue)
        tracked.loop.call_soon_threadsafe(tracked.sink.put_nowait, chunk)


def _node_ip() -> str:
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return socket.gethostbyname(socket.gethostname())


def _resolve(future: asyncio.Future[PrefillResult], result: PrefillResult) -> None:
    if not future.done():
        future.set_result(result)


def _worker_metrics(worker_id: str, role: WorkerRole) -> WorkerMetrics | None:
    try:
        return WorkerMetrics(worker_id, role)
    except Exception as exc:  # noqa: BLE001 - metrics must never stop a worker
        log.warning("%s: no metrics (%s)", worker_id, exc)
        return None


@ray.remote
class PrefillWorker(EngineWorker):
    """A prefill worker actor: runs prefill-only requests (P/D) and colocated short requests."""

    role: WorkerRole = "prefill"


@ray.remote
class DecodeWorker(EngineWorker):
    """A decode worker actor: pulls prefilled KV and decodes, or runs whole requests."""

    role: WorkerRole = "decode"
