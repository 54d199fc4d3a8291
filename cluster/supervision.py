"""Worker health as the driver sees it: a periodic check of every worker, what happens to a
worker that fails it, and its replacement. A mixin of ``Cluster`` (it reads the worker and router
handles, the requests in flight and the config that ``Cluster`` owns).

Every ``workers.health_check_interval_s`` the driver calls each worker's ``health`` (which also
renews the leases of the requests this driver waits on there). A worker that raises (its engine
stopped), does not answer within ``workers.health_check_timeout_s`` (hung, frozen, its node
gone) or whose actor died is *lost*: it leaves this driver and the router at once, the requests
waiting on it are cut loose (``_collect`` routes again the ones that streamed nothing and fails
the others with an error naming the worker), and the process that started it (``Cluster.start``,
not an attached driver) kills it and starts a replacement under the same id, which rejoins the
router. Attached drivers adopt replacements from the router's registry.

The router is watched too: Ray restarts a router process that dies (its pins come back from their
journal, see ``actors.pin_journal``), and the process that started the cluster notices the new
incarnation and registers every live worker with it again, each sending a full snapshot of its
prefix cache. Meanwhile requests are placed by ``fallback_decision`` instead of failing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

REPLACE_RETRY_S = 5.0  # wait this long before trying again to start a replacement
STOP_TIMEOUT_S = 15.0  # at shutdown, wait this long for the health loop and replacements to end


class ClusterSupervision:
    """Owns the driver's health loop, the record of lost workers (``lost``: id -> why) and the
    replacements in progress.

    Invariants: a worker id is in at most one of ``workers`` and ``lost``; a lost worker is never
    routed to by this driver; only the process that started the actors replaces them.
    """

    config: Any
    router: Any
    workers: dict[str, Any]
    infos: dict[str, Any]
    _active: dict[str, Any]
    _owns_actors: bool
    _loop: asyncio.AbstractEventLoop | None

    def _init_supervision(self) -> None:
        self.lost: dict[str, str] = {}
        self._replacing: set[str] = set()
        self._background: set[concurrent.futures.Future[Any]] = set()  # the health loop, replacements
        self._closing = False
        self.replacements = 0
        self.router_incarnation: str | None = None
        self.router_rejoins = 0
        self._fallback_turn = 0

    def _start_supervision(self) -> None:
        assert self._loop is not None
        self._closing = False
        self._in_background(self._supervise())

    def _in_background(self, coro: Any) -> None:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    def _stop_supervision(self) -> None:
        """Cancel the health loop and any replacement in progress, and wait until they ended (a
        replacement being started is killed), so nothing of the driver runs on after shutdown."""
        self._closing = True
        pending = list(self._background)
        for future in pending:
            future.cancel()
        if pending and threading.current_thread() is not getattr(self, "_loop_thread", None):
            concurrent.futures.wait(pending, timeout=STOP_TIMEOUT_S)

    async def _supervise(self) -> None:
        interval = self.config.workers.health_check_interval_s
        while not self._closing:
            await asyncio.sleep(interval)
            try:
                await self.check_workers()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any one failed round
                log.exception("worker health check failed")

    async def check_workers(self) -> dict[str, str]:
        """One round: every worker's health (renewing this driver's leases on it); a worker that
        fails is lost. Returns ``{worker id: "ok" or why not}`` for the workers checked."""
        if not self._owns_actors:
            await self._adopt_registered()
        timeout_s = self.config.workers.health_check_timeout_s
        renew: dict[str, list[str]] = {wid: [] for wid in self.workers}
        for request in list(self._active.values()):
            for worker_id in request.worker_ids:
                if worker_id in renew:
                    renew[worker_id].append(request.engine_id)
        checked = dict(self.workers)
        verdicts = await asyncio.gather(*(probe(h, timeout_s, renew[w]) for w, h in checked.items()))
        results = dict(zip(checked, verdicts, strict=True))
        for worker_id, verdict in results.items():
            if verdict != "ok":
                self._forget_worker(worker_id, verdict, checked[worker_id])
        if self._owns_actors:  # after the checks: only workers that just answered are registered again
            await self._watch_router()
        return results

    def _forget_worker(self, worker_id: str, why: str = "its actor died", handle: Any = None) -> None:
        """Take a lost worker out of this driver and the router, cut loose the requests waiting
        on it, and (in the process that started it) replace it."""
        current = self.workers.get(worker_id)
        if current is None or (handle is not None and current is not handle):
            return  # already lost, or a replacement holds the id now
        del self.workers[worker_id]
        self.lost[worker_id] = why
        log.error("worker %s lost (%s); removing it from the router", worker_id, why)
        if self.router is not None:
            self.router.remove_worker.remote(worker_id, current._actor_id.hex())
        for request in list(self._active.values()):
            if worker_id in request.worker_ids:
                request.cut_loose(worker_id)
        if self._owns_actors and self.config.workers.replace_failed and self._loop is not None:
            if worker_id not in self._replacing:
                self._replacing.add(worker_id)
                self._in_background(self._replace(worker_id, current))

    async def _replace(self, worker_id: str, old: Any) -> None:
        """Kill a lost worker and start another under its id until one joins (or we shut down)."""
        try:  # off the driver's loop: killing a frozen process may take a while
            await asyncio.get_running_loop().run_in_executor(None, _kill, old)
        except Exception as exc:  # already gone
            log.debug("kill %s: %s", worker_id, exc)
        try:
            while not self._closing:
                started = time.monotonic()
                try:
                    await self._start_replacement(worker_id)
                    self.replacements += 1
                    log.warning("worker %s replaced in %.1f s", worker_id, time.monotonic() - started)
                    return
                except Exception as exc:
                    log.error("could not start a replacement for %s (%s); retrying", worker_id, describe_failure(exc))
                    await asyncio.sleep(REPLACE_RETRY_S)
        finally:
            self._replacing.discard(worker_id)

    async def _start_replacement(self, worker_id: str) -> None:
        import ray

        log.info("starting a replacement for %s", worker_id)
        from actors.worker import DecodeWorker, PrefillWorker
        from cluster.placement import worker_options

        config = self.config
        old_info = self.infos[worker_id]
        actor_class = PrefillWorker if old_info.role == "prefill" else DecodeWorker
        options = worker_options(config, old_info.role, ray.cluster_resources())
        handle = actor_class.options(**options).remote(config, worker_id, config.workers.num_prefill > 0)
        try:
            start_timeout_s = config.workers.health_check_timeout_s * 30
            info = await asyncio.wait_for(await_ref(handle.info.remote()), start_timeout_s)
            if info.groups != old_info.groups or info.block_size != old_info.block_size:
                raise RuntimeError(f"{worker_id}: the replacement's KV layout differs from the cluster's")
            if self._closing:
                raise RuntimeError("the cluster is shutting down")
            await await_ref(self.router.add_worker.remote(worker_id, info.router_role, info.num_blocks, handle))
            await await_ref(handle.set_router.remote(self.router))
        except BaseException:
            _kill(handle)
            raise
        self.infos[worker_id] = info
        self.workers[worker_id] = handle
        self.lost.pop(worker_id, None)

    async def _watch_router(self) -> None:
        """Register every live worker again with a router Ray restarted (a new incarnation)."""
        timeout_s = self.config.workers.health_check_timeout_s
        try:
            incarnation = await asyncio.wait_for(await_ref(self.router.identity.remote()), timeout_s)
        except Exception as exc:  # down or restarting: requests fall back until it is back
            log.warning("router did not answer (%s); placing requests without it", describe_failure(exc))
            return
        if self.router_incarnation is None:
            self.router_incarnation = incarnation
        restarted = incarnation != self.router_incarnation
        registered = await await_ref(self.router.worker_handles.remote())
        missing = [w for w, h in self.workers.items() if w not in registered or registered[w]._actor_id != h._actor_id]
        if missing:
            await self._register_again(missing, "router restarted" if restarted else "router lacks workers")
        if restarted:
            self.router_incarnation = incarnation
            self.router_rejoins += 1

    async def _register_again(self, missing: list[str], why: str) -> None:
        log.warning("%s; registering %s with it again", why, ", ".join(sorted(missing)))
        for worker_id in missing:  # e.g. a replacement that joined the router just before it died
            handle, info = self.workers.get(worker_id), self.infos[worker_id]
            if handle is None:
                continue
            try:
                await await_ref(self.router.add_worker.remote(worker_id, info.router_role, info.num_blocks, handle))
                await await_ref(handle.set_router.remote(self.router))
                handle.snapshot.remote()
            except Exception as exc:  # it failed since its check: lost, not registered
                self._forget_worker(worker_id, describe_failure(exc), handle)

    def fallback_decision(self, request_id: str, num_tokens: int) -> Any:
        """Where a request runs while the router cannot be asked: whole on the next live worker
        that decodes (no prefix knowledge; exact tokens all the same)."""
        from engine.routing import Decision

        candidates = sorted(w for w in self.workers if self.infos[w].role == "decode")
        if not candidates:
            raise RuntimeError(f"request {request_id}: the router is unavailable and no decode worker is alive")
        self._fallback_turn += 1
        worker = candidates[self._fallback_turn % len(candidates)]
        return Decision(worker, worker, 0, num_tokens, reason="fallback")

    async def _adopt_registered(self) -> None:
        """An attached driver takes the replacements the owner registered with the router."""
        registered = await await_ref(self.router.worker_handles.remote())
        for worker_id, handle in registered.items():
            current = self.workers.get(worker_id)
            if worker_id in self.infos and (current is None or current._actor_id != handle._actor_id):
                self.workers[worker_id] = handle
                self.lost.pop(worker_id, None)
                log.info("adopted worker %s from the router", worker_id)


async def probe(handle: Any, timeout_s: float, renew: list[str] | None = None) -> str:
    """A worker's health: "ok", or why not (a dead actor, a stopped engine, no answer in time).
    ``renew``: the request ids whose leases the call renews there."""
    try:
        await asyncio.wait_for(await_ref(handle.health.remote(renew)), timeout_s)
        return "ok"
    except TimeoutError:
        return f"did not answer a health check within {timeout_s:g} s"
    except Exception as exc:
        return describe_failure(exc)


def describe_failure(exc: BaseException) -> str:
    """One line saying why a worker call failed (a dead actor, a stopped engine, ...)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}".strip()


def _kill(handle: Any) -> None:
    import ray

    if ray.is_initialized():  # never start a Ray just to kill an actor of one that is gone
        ray.kill(handle, no_restart=True)


async def await_ref(ref: Any) -> Any:
    """A Ray object ref as a coroutine (for ``asyncio.wait_for`` / ``gather``)."""
    return await ref
