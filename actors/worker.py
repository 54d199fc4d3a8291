"""Prefill and decode worker actors: one EngineCore each, stepped by a background thread.

The actor is an asyncio actor, so it keeps accepting calls (new requests, aborts, pins, stats)
while the engine computes. Every engine access happens on the engine thread: actor methods
enqueue a command and await its result. Tokens stream back per request through a Ray streaming
generator (``generate``); a prefill-only request resolves to its ``KVHandle`` (``prefill``).

After each step the thread reports the engine's KV events and load to the router actor; it
never waits for the router. A finished request's last output (the final chunk, or a prefill's
result) carries the ref of the report that holds its blocks (``router_ack``): the driver awaits
it before it calls the request finished, so a request routed after another finished sees that
request's cached blocks, and the engine loop never blocks on the router.

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

A request's path on the engine thread (intake, handles, aborts, leases, replies) is the
``WorkerRequests`` mixin (``actors.worker_requests``); the router protocol is ``RouterLink``.

No policy lives here: the router decides placement and pins; this only executes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import ray

from actors.router_link import RouterLink
from actors.worker_requests import (  # noqa: F401  (the constants: re-exported, they lived here)
    EARLY_HANDLE_WAIT_S,
    MAX_TOMBSTONES,
    REMOTE_DECODE,
    WorkerRequests,
)
from actors.worker_types import (  # noqa: F401  (re-exported: drivers import them from here)
    PrefillResult,
    TokenChunk,
    WorkerInfo,
    WorkerRole,
    WorkerUnavailableError,
    _Tracked,
)
from configs.schema import ClusterConfig
from engine.routing import WorkerLoad
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # nothing to do: wait this long for a command
TRANSFER_WAIT_S = 0.002  # only transfers in flight / blocks held: poll this often
LEASE_SWEEP_INTERVAL_S = 1.0  # how often the engine thread looks for requests whose lease ran out


class EngineWorker(WorkerRequests, RouterLink):
    """Owns one EngineCore and the thread that steps it; the body of both worker actors.

    Invariants: only the engine thread touches ``self.engine``; every request in ``_tracked``
    is in the engine (or just left it and is being answered); a request's stream receives
    exactly one ``finished`` chunk.
    """

    role: WorkerRole = "decode"

    def __init__(self, config: ClusterConfig, worker_id: str, disaggregated: bool):
        from cluster.logs import setup_logging
        from engine.core import EngineCore

        setup_logging(config.logging)
        self.config = config
        self.worker_id = worker_id
        resources = config.workers.prefill if self.role == "prefill" else config.workers.decode
        kv_role = self.role if disaggregated else None
        self.router_role: Literal["prefill", "decode", "both"] = self.role if disaggregated else "both"
        self.engine = EngineCore(config, threads=resources.num_threads, name=worker_id, kv_role=kv_role)
        self._commands: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]]
        self._commands = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()  # aborted before they arrived
        self._early_handles: dict[str, tuple[Any, float]] = {}  # handles that overtook their request
        self._router: Any = None
        self._last_report: Any = None
        self._last_load: WorkerLoad | None = None
        self._last_report_at = 0.0
        self._stopped = False
        self._error: str | None = None
        self._steps = 0
        self._leases: dict[str, float] = {}  # request id -> when its driver last renewed it
        self._last_loop = time.monotonic()  # when the engine thread last came round its loop
        self._last_sweep = 0.0
        self.metrics = _worker_metrics(worker_id, self.role)
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
            tuple(engine.kv_groups),
            str(engine.model_directory),
            _node_ip(),
            os.getpid(),
            engine.agent_info if engine.transfer is not None else None,
        )

    async def set_router(self, router: Any) -> None:
        """Start reporting KV events and load to ``router`` (a Router actor handle)."""
        await self._call(self._set_router, router)

    def _set_router(self, router: Any) -> None:
        self._router = router
        self._report(force=True)

    async def health(self, renew: list[str] | None = None) -> dict[str, Any]:
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

    # -- requests ----------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_handle: Any = None,
        expect_handle: bool = False,
        peer: Any = None,
    ) -> AsyncIterator[TokenChunk]:
        """Run a request to the end here (pulling its prompt's KV first when given a handle);
        yields a ``TokenChunk`` whenever tokens arrive, the last one with ``finished=True``.
        ``expect_handle``: a prefill worker (transfer agent ``peer``) is computing the prompt's
        KV now; reserve its blocks and wait for the handle (``deliver``)."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()
        tracked = _Tracked(loop, chunks, len(prompt_token_ids))
        await self._call(self._add, request_id, prompt_token_ids, sampling, tracked, kv_handle, False,
                         expect_handle, peer)  # fmt: skip
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                while not chunks.empty() and not chunk.finished:  # coalesce what piled up
                    more = chunks.get_nowait()
                    chunk = dataclasses.replace(more, token_ids=chunk.token_ids + more.token_ids,
                                                hops=chunk.hops or more.hops)  # fmt: skip
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:  # the consumer went away (cancelled, or the driver died)
                self._submit(self._abort, request_id)

    async def prefill(self, request_id: str, prompt_token_ids: list[int]) -> PrefillResult:
        """Compute the KV of the prompt's first N - 1 tokens for a decode worker to pull."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[PrefillResult] = loop.create_future()
        tracked = _Tracked(loop, done, len(prompt_token_ids))
        await self._call(self._add, request_id, prompt_token_ids, SamplingParams(max_tokens=1), tracked, None, True)
        try:
            return await done
        except asyncio.CancelledError:
            self._submit(self._abort, request_id)
            raise

    async def deliver(self, request_id: str, kv_handle: Any) -> None:
        """The handle of a request announced with ``expect_handle``: start reading its KV."""
        await self._call(self._deliver, request_id, kv_handle, time.monotonic())

    async def warm_peers(self, agents: list[Any]) -> int:
        """Open the transfer connection to each of these prefill workers' agents now (so their
        first reads pay no setup); returns how many were new."""
        return int(await self._call(lambda: sum(self.engine.warm_peer(agent) for agent in agents)))

    async def abort(self, request_id: str) -> bool:
        """Stop a request here and free its blocks; its stream ends with ``finish_reason="abort"``."""
        return bool(await self._call(self._abort, request_id))

    async def stats(self) -> dict[str, Any]:
        """The engine's counters plus this worker's identity and hit rate (plain data)."""
        stats = await self._call(self.engine.stats)
        stats.update(worker_id=self.worker_id, role=self.role, requests=len(self._tracked))
        queried = stats["queried_tokens"]
        stats["hit_rate"] = stats["hit_tokens"] / queried if queried else 0.0
        stats["metrics"] = self.metrics.snapshot() if self.metrics is not None else {}
        return stats

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
                    if outputs:
                        self._dispatch(outputs)
                self._report()
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
                except BaseException as exc:  # errors go back to the caller, the loop goes on
                    future.set_exception(exc)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return


def _node_ip() -> str:
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return socket.gethostbyname(socket.gethostname())


def _worker_metrics(worker_id: str, role: WorkerRole) -> Any:
    try:
        from actors.metrics import WorkerMetrics
    except ImportError:
        return None
    try:
        return WorkerMetrics(worker_id, role)
    except Exception as exc:  # metrics must never stop a worker
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
