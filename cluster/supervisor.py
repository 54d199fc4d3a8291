"""The cluster's actors as the driver sees them: starting the workers and the router, a periodic
check of every worker, what happens to a worker that fails it, its replacement, and stopping
them all. ``Supervisor`` is owned by ``cluster.api.Cluster``.

Every ``workers.health_check_interval_s`` the driver calls each worker's ``health`` (which also
renews the leases of the requests this driver waits on there). A worker that raises (its engine
stopped), does not answer within ``workers.health_check_timeout_s`` (hung, frozen, its node
gone) or whose actor died is *lost*: it leaves this driver and the router at once, the requests
waiting on it are cut loose (the request runner routes again the ones that streamed nothing and
fails the others with an error naming the worker), and the process that started it
(``Cluster.start``, not an attached driver) kills it and starts a replacement under the same id,
which rejoins the router. Attached drivers adopt replacements from the router's registry.

The router is watched too: Ray restarts a router process that dies (its pins come back from their
journal, see ``actors.pin_journal``), and the process that started the cluster notices the new
incarnation and registers every live worker with it again, each sending a full snapshot of its
prefix cache. Meanwhile requests are placed by ``Supervisor.fallback_decision`` instead of failing.

With ``router.replicas`` = N > 1 there are N router actors, each registered with every worker
(each worker reports to all of them) and each watched and restarted alone the same way; a
request asks the replica its first block's hash picks (``route_order``), and while that one is
down the next replica in turn, which holds the same index: only when none answers does the
fallback place it. Pins go to the replica holding the pin lease (``actors.pin_lease``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from cluster.driver_loop import DriverLoop
from cluster.handles import RouterHandle, WorkerHandle
from cluster.in_flight import InFlight
from cluster.rank_groups import RankGroups
from cluster.served_model import same_kv_layout
from cluster.tier_stats import hit_tokens_by_tier, hit_tokens_by_tier_totals, host_tier_summary, host_tier_totals
from configs import ClusterConfig

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorClass

    from actors.router import Router
    from actors.worker import DecodeWorker, PrefillWorker
    from actors.worker_types import WorkerInfo, WorkerRole
    from engine.routing import Decision

log = logging.getLogger(__name__)

T = TypeVar("T")


REPLACE_RETRY_S = 5.0  # wait this long before trying again to start a replacement
STOP_TIMEOUT_S = 15.0  # at shutdown, wait this long for the health loop and replacements to end
ACTOR_CALL_TIMEOUT_S = 120.0  # at start: the router's readiness, registrations, connection warm-up


class Supervisor:
    """Owns the cluster's actors as this driver sees them: the worker handles (``workers``),
    what each worker reported when it started (``infos``), the router handle, the record of lost
    workers (``lost``: id -> why), the health loop and the replacements in progress.

    Invariants: a worker id is in at most one of ``workers`` and ``lost``; a lost worker is never
    routed to by this driver; only the process that started the actors replaces, re-registers
    and stops them (an attached driver only drives them); nothing of the health loop runs on
    after ``stop``; ``routers`` holds one handle per router replica, in replica order, and
    ``router_incarnations`` the incarnation last seen of each.
    """

    def __init__(self, config: ClusterConfig, loop: DriverLoop, in_flight: InFlight) -> None:
        self.config = config
        self.workers: dict[str, WorkerHandle] = {}
        self.infos: dict[str, WorkerInfo] = {}
        self.routers: list[RouterHandle] = []
        self.lost: dict[str, str] = {}
        self.replacements = 0
        self.router_incarnations: list[str | None] = []
        self.router_rejoins = 0
        self._loop = loop
        self._in_flight = in_flight
        self._owns_actors = True
        #: the placement groups and other ranks of split workers (``workers.tensor_parallel_size``)
        self.ranks = RankGroups(config)
        self._replacing: set[str] = set()
        self._background: set[concurrent.futures.Future[None]] = set()  # the health loop, replacements
        self._closing = False
        self._fallback_turn = 0

    @property
    def router(self) -> RouterHandle:
        """Router replica 0 (the only one unless ``router.replicas`` > 1); None when stopped."""
        return self.routers[0] if self.routers else None

    @property
    def router_incarnation(self) -> str | None:
        return self.router_incarnations[0] if self.router_incarnations else None

    def route_order(self, block_hashes: Sequence[bytes]) -> list[RouterHandle]:
        """The router replicas to ask for a prompt with these block hashes, in order: the one
        its first block's hash picks (so one prefix's decisions stay on one replica), then the
        others in turn (they hold the same index) for while it is down."""
        n = len(self.routers)
        first = replica_for(block_hashes, n)
        return [self.routers[(first + k) % n] for k in range(n)]

    # -- starting and stopping the actors ----------------------------------------------------------
    def start_workers(self, resources: dict[str, float], start_timeout_s: float) -> dict[str, WorkerInfo]:
        """Start the prefill and decode workers the config asks for on a Ray cluster with
        ``resources``; wait up to ``start_timeout_s`` until each reported what it is."""
        from cluster.placement import worker_options

        config = self.config
        disaggregated = config.workers.num_prefill > 0
        for i in range(config.workers.num_prefill):
            options = worker_options(config, "prefill", resources)
            worker_id = f"prefill-{i}"
            self.workers[worker_id] = self.ranks.launch(_worker_class("prefill"), worker_id, "prefill", options, True)
        for i in range(config.workers.num_decode):
            options = worker_options(config, "decode", resources)
            worker_id = f"decode-{i}"
            self.workers[worker_id] = self.ranks.launch(
                _worker_class("decode"), worker_id, "decode", options, disaggregated
            )
        self.infos = self._wait_ready({wid: w.info.remote() for wid, w in self.workers.items()}, start_timeout_s)
        return dict(self.infos)

    def _wait_ready(self, refs: dict[str, ObjectRef[WorkerInfo]], timeout_s: float) -> dict[str, WorkerInfo]:
        import ray

        pending = list(refs.values())
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        if pending:
            waiting = [wid for wid, ref in refs.items() if ref in pending]
            raise TimeoutError(
                f"workers {waiting} not ready after {timeout_s:.0f} s (not enough Ray resources, "
                f"or the model is still loading); available: {ray.available_resources()}"
            )
        return {wid: ray.get(ref) for wid, ref in refs.items()}

    def start_router(self) -> None:
        """Start the router replicas, register every worker with each (and each with every
        worker), then have the decode workers open their transfer connections to the prefill
        workers."""
        import ray

        from actors.router import Router
        from cluster.placement import ROUTER_NUM_CPUS

        first = next(iter(self.infos.values()))
        router_class = cast("ActorClass[Router]", Router)  # what @ray.remote made of it (mypy cannot see)
        cluster_key = uuid.uuid4().hex
        # Ray restarts a router that dies; this process then registers the workers with it again
        self.routers = [
            router_class.options(num_cpus=ROUTER_NUM_CPUS, max_restarts=-1).remote(
                self.config, first.groups, cluster_key, replica
            )
            for replica in range(self.config.router.replicas)
        ]
        self.router_incarnations = [None] * len(self.routers)
        ray.get([router.ready.remote() for router in self.routers], timeout=ACTOR_CALL_TIMEOUT_S)
        ray.get(
            [
                router.add_worker.remote(wid, info.router_role, info.num_blocks, self.workers[wid])
                for router in self.routers
                for wid, info in self.infos.items()
            ]
        )
        ray.get(
            [w.set_router.remote(router, k) for k, router in enumerate(self.routers) for w in self.workers.values()],
            timeout=ACTOR_CALL_TIMEOUT_S,
        )
        self._warm_connections()

    def _warm_connections(self) -> None:
        """Have every decode worker open its transfer connection to every prefill worker now, so
        no request's first read pays the setup (a worker that joins later is warmed when a
        decode worker first hears of it with a request)."""
        import ray

        infos = self.infos
        agents = [info.agent for info in infos.values() if info.role == "prefill" and info.agent is not None]
        decoders = [self.workers[w] for w, info in infos.items() if info.role == "decode" and info.agent is not None]
        if agents and decoders:
            ray.get([d.warm_peers.remote(agents) for d in decoders], timeout=ACTOR_CALL_TIMEOUT_S)

    def attach(
        self, workers: Mapping[str, WorkerHandle], infos: Mapping[str, WorkerInfo], routers: Sequence[RouterHandle]
    ) -> None:
        """Drive actors another process started: this supervisor never replaces, re-registers
        or stops them."""
        self._owns_actors = False
        self.workers = dict(workers)
        self.infos = dict(infos)
        self.routers = list(routers)
        self.router_incarnations = [None] * len(self.routers)

    def stop_actors(self) -> None:
        """Stop the workers and the router where this process started them, and forget them."""
        import ray

        if ray.is_initialized() and self._owns_actors:
            if self.workers:
                refs = [w.shutdown.remote() for w in self.workers.values()]
                try:
                    ray.wait(refs, num_returns=len(refs), timeout=30)
                except Exception as exc:  # noqa: BLE001  (dead actors: nothing to stop)
                    log.debug("worker shutdown: %s", exc)
            for handle in [*self.workers.values(), *self.routers]:
                if handle is not None:
                    try:
                        ray.kill(handle)
                    except Exception as exc:  # noqa: BLE001  (already gone)
                        log.debug("kill: %s", exc)
            self.ranks.release_all(_kill)
        self.workers.clear()
        self.routers = []

    # -- the health loop -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the health loop on the driver's loop (which must be running)."""
        self._closing = False
        self._in_background(self._supervise())

    def stop(self) -> None:
        """Cancel the health loop and any replacement in progress, and wait until they ended (a
        replacement being started is killed), so nothing of the driver runs on after shutdown."""
        self._closing = True
        pending = list(self._background)
        for future in pending:
            future.cancel()
        if pending and not self._loop.on_loop_thread():
            concurrent.futures.wait(pending, timeout=STOP_TIMEOUT_S)

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        future = self._loop.submit(coro)
        self._background.add(future)
        future.add_done_callback(self._background.discard)

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
        renew = self._in_flight.leases(self.workers)
        checked = dict(self.workers)
        verdicts = await asyncio.gather(*(probe(h, timeout_s, renew[w]) for w, h in checked.items()))
        results = dict(zip(checked, verdicts, strict=True))
        for worker_id, verdict in results.items():
            if verdict != "ok":
                self.forget_worker(worker_id, verdict, checked[worker_id])
        if self._owns_actors:  # after the checks: only workers that just answered are registered again
            await self._watch_router()
        return results

    def forget_worker(self, worker_id: str, why: str = "its actor died", handle: WorkerHandle = None) -> None:
        """Take a lost worker out of this driver and the router, cut loose the requests waiting
        on it, and (in the process that started it) replace it. ``handle``: the actor that
        failed (None: whichever holds the id); a replacement that holds the id by now stays."""
        current = self.workers.get(worker_id)
        if current is None or (handle is not None and current is not handle):
            return  # already lost, or a replacement holds the id now
        del self.workers[worker_id]
        self.lost[worker_id] = why
        log.error("worker %s lost (%s); removing it from the router", worker_id, why)
        for router in self.routers:
            router.remove_worker.remote(worker_id, current._actor_id.hex())
        self._in_flight.cut_loose(worker_id)
        replace = self._owns_actors and self.config.workers.replace_failed and self._loop.running
        if replace and worker_id not in self._replacing:
            self._replacing.add(worker_id)
            self._in_background(self._replace(worker_id, current))
        elif self._owns_actors and not replace:
            self.ranks.release(worker_id, _kill)  # a split worker's other ranks go with it

    async def _replace(self, worker_id: str, old: WorkerHandle) -> None:
        """Kill a lost worker and start another under its id until one joins (or we shut down)."""
        try:  # off the driver's loop: killing a frozen process may take a while
            await asyncio.get_running_loop().run_in_executor(None, _kill, old)
        except Exception as exc:  # noqa: BLE001  (already gone)
            log.debug("kill %s: %s", worker_id, exc)
        await asyncio.get_running_loop().run_in_executor(None, self.ranks.release, worker_id, _kill)
        try:
            while not self._closing:
                started = time.monotonic()
                try:
                    await self._start_replacement(worker_id)
                    self.replacements += 1
                    log.warning("worker %s replaced in %.1f s", worker_id, time.monotonic() - started)
                    return
                except Exception as exc:  # noqa: BLE001  (any failure to start: retry until shutdown)
                    log.error("could not start a replacement for %s (%s); retrying", worker_id, describe_failure(exc))
                    await asyncio.sleep(REPLACE_RETRY_S)
        finally:
            self._replacing.discard(worker_id)

    async def _start_replacement(self, worker_id: str) -> None:
        import ray

        log.info("starting a replacement for %s", worker_id)
        from cluster.placement import worker_options

        config = self.config
        old_info = self.infos[worker_id]
        options = worker_options(config, old_info.role, ray.cluster_resources())
        role, disaggregated = old_info.role, config.workers.num_prefill > 0
        launch = functools.partial(self.ranks.launch, _worker_class(role), worker_id, role, options, disaggregated)
        handle: WorkerHandle = await asyncio.get_running_loop().run_in_executor(None, launch)
        try:
            start_timeout_s = config.workers.health_check_timeout_s * 30
            info: WorkerInfo = await asyncio.wait_for(await_ref(handle.info.remote()), start_timeout_s)
            if not same_kv_layout(info, old_info):
                raise RuntimeError(f"{worker_id}: the replacement's KV layout differs from the cluster's")
            if self._closing:
                raise RuntimeError("the cluster is shutting down")
            for k, router in enumerate(self.routers):
                await await_ref(router.add_worker.remote(worker_id, info.router_role, info.num_blocks, handle))
                await await_ref(handle.set_router.remote(router, k))
        except BaseException:
            _kill(handle)
            self.ranks.release(worker_id, _kill)
            raise
        self.infos[worker_id] = info
        self.workers[worker_id] = handle
        self.lost.pop(worker_id, None)

    async def _watch_router(self) -> None:
        """Register every live worker again with a router replica Ray restarted (a new
        incarnation); each replica is watched alone, the others route meanwhile."""
        await asyncio.gather(*(self._watch_replica(k) for k in range(len(self.routers))))

    async def _watch_replica(self, replica: int) -> None:
        router = self.routers[replica]
        timeout_s = self.config.workers.health_check_timeout_s
        try:
            incarnation = await asyncio.wait_for(await_ref(router.identity.remote()), timeout_s)
        except Exception as exc:  # noqa: BLE001  (down or restarting: its requests go elsewhere until it is back)
            log.warning("router replica %d did not answer (%s); routing without it", replica, describe_failure(exc))
            return
        if self.router_incarnations[replica] is None:
            self.router_incarnations[replica] = incarnation
        restarted = incarnation != self.router_incarnations[replica]
        registered = await await_ref(router.worker_handles.remote())
        missing = [w for w, h in self.workers.items() if w not in registered or registered[w]._actor_id != h._actor_id]
        if missing:
            why = f"router replica {replica} " + ("restarted" if restarted else "lacks workers")
            await self._register_again(replica, missing, why)
        if restarted:
            self.router_incarnations[replica] = incarnation
            self.router_rejoins += 1

    async def _register_again(self, replica: int, missing: list[str], why: str) -> None:
        log.warning("%s; registering %s with it again", why, ", ".join(sorted(missing)))
        router = self.routers[replica]
        for worker_id in missing:  # e.g. a replacement that joined the router just before it died
            handle, info = self.workers.get(worker_id), self.infos[worker_id]
            if handle is None:
                continue
            try:
                await await_ref(router.add_worker.remote(worker_id, info.router_role, info.num_blocks, handle))
                await await_ref(handle.set_router.remote(router, replica))
                handle.snapshot.remote(replica)
            except Exception as exc:  # noqa: BLE001  (it failed since its check: lost, not registered)
                self.forget_worker(worker_id, describe_failure(exc), handle)

    def fallback_decision(self, request_id: str, num_tokens: int) -> Decision:
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
        registered: dict[str, WorkerHandle] = {}
        for router in self.routers:  # the first replica that answers (each has every worker)
            try:
                registered = await await_ref(router.worker_handles.remote())
                break
            except Exception as exc:  # noqa: BLE001  (a replica restarting: ask the next)
                log.debug("router replica did not answer (%s)", describe_failure(exc))
        for worker_id, handle in registered.items():
            current = self.workers.get(worker_id)
            if worker_id in self.infos and (current is None or current._actor_id != handle._actor_id):
                self.workers[worker_id] = handle
                self.lost.pop(worker_id, None)
                log.info("adopted worker %s from the router", worker_id)

    # -- what the operator asks ----------------------------------------------------------------------
    async def stats(self, timeout_s: float) -> dict[str, Any]:
        """Per worker: running, queued, free / total / pinned blocks, hit rate; totals; the
        router's stats. A worker that fails to answer is listed under ``unhealthy`` (a dead
        actor is also lost); this never raises for a worker."""
        from ray.exceptions import RayActorError

        raw = []
        unhealthy: dict[str, str] = {wid: f"lost: {why}" for wid, why in self.lost.items()}
        handles = dict(self.workers)
        refs = {worker_id: handle.stats.remote() for worker_id, handle in handles.items()}
        for worker_id, ref in refs.items():
            try:
                raw.append(await asyncio.wait_for(await_ref(ref), timeout_s))
            except TimeoutError:
                unhealthy[worker_id] = f"stats did not answer within {timeout_s:g} s"
            except Exception as exc:  # noqa: BLE001  (a dead actor, a stopped engine: report it, never raise)
                unhealthy[worker_id] = describe_failure(exc)
                if isinstance(exc, RayActorError):
                    self.forget_worker(worker_id, unhealthy[worker_id], handles[worker_id])
        workers = {stats["worker_id"]: worker_summary(stats) for stats in raw}
        keys = (
            "running",
            "queued",
            "held_for_transfer",
            "free_blocks",
            "num_blocks",
            "pinned_blocks",
            "capacity_tokens",
            "capacity_recurrent_states",
            "explicitly_pinned_blocks",
            "hit_tokens",
            "queried_tokens",
            "transfer_bytes",
            "transfers",
            "transfer_seconds",
            "requests_finished",
            "requests_aborted",
        )
        totals: dict[str, Any] = {k: sum(w[k] for w in workers.values()) for k in keys}
        totals["hit_rate"] = totals["hit_tokens"] / totals["queried_tokens"] if totals["queried_tokens"] else 0.0
        totals["hit_tokens_by_tier"] = hit_tokens_by_tier_totals(workers)
        totals["host_tier"] = host_tier_totals(workers)
        return {"workers": workers, "unhealthy": unhealthy, "totals": totals, "router": await self.router_stats()}

    async def router_stats(self) -> dict[str, Any]:
        """The router's stats; with replicas, the counts summed over the replicas that answer,
        the pins of the one that decides them, and each replica's own under ``replicas``."""
        answers = await asyncio.gather(*(await_ref(r.stats.remote()) for r in self.routers), return_exceptions=True)
        each = [a for a in answers if isinstance(a, dict)]
        if len(self.routers) == 1:
            if not each:
                raise cast("BaseException", answers[0])
            return each[0]
        merged = dict(each[0]) if each else {"policy": self.config.router.policy}
        for key in ("routed", "disaggregated", "prompt_tokens", "predicted_hit_tokens"):
            merged[key] = sum(int(a.get(key, 0)) for a in each)
        for key in ("reasons", "route_outcomes"):
            total: dict[str, Any] = {}
            for a in each:
                _add_counts(total, a.get(key, {}))
            merged[key] = total
        merged["pins"] = [p for a in each for p in a.get("pins", [])]  # only the leader lists pins
        merged["replicas"] = [a if isinstance(a, dict) else {"error": describe_failure(a)} for a in answers]
        return merged

    async def on_pin_router(self, method: str, *args: Any) -> Any:
        """Call ``method`` of the router replica that decides pins; once more when the lease
        moved between finding its holder and the call (``NotPinLeaderError``)."""
        from ray.exceptions import RayTaskError

        from actors.router import NotPinLeaderError

        for attempt in range(2):
            router = await self.pin_router()
            try:
                return await getattr(router, method).remote(*args)
            except RayTaskError as exc:
                if attempt or not isinstance(exc.cause, NotPinLeaderError):
                    raise
                log.warning("pin lease moved (%s); asking its holder", exc.cause)
        raise AssertionError("unreachable")

    async def pin_router(self) -> RouterHandle:
        """The router replica that decides pins (the pin lease's holder; replica 0 claims a free
        lease)."""
        if len(self.routers) == 1:
            return self.router
        for router in self.routers:
            try:
                leader = await await_ref(router.pin_leader.remote())
            except Exception as exc:  # noqa: BLE001  (a replica restarting: ask the next)
                log.debug("router replica did not answer (%s)", describe_failure(exc))
                continue
            if leader is not None:
                return self.routers[leader]
        raise RuntimeError("no router replica holds the pin lease (all restarting?); try again")

    async def health(self, timeout_s: float) -> dict[str, str]:
        """Every worker this cluster started, with "ok" or why it is not healthy (an engine
        thread that stopped, an actor that died or did not answer within ``timeout_s``)."""
        names = list(self.infos)

        async def one(worker_id: str) -> str:
            handle = self.workers.get(worker_id)
            if handle is None:
                return f"lost: {self.lost.get(worker_id, 'removed from the router')}"
            return await probe(handle, timeout_s)

        return dict(zip(names, await asyncio.gather(*(one(w) for w in names)), strict=True))


def replica_for(block_hashes: Sequence[bytes], replicas: int) -> int:
    """The router replica (of ``replicas``) that routes a prompt with these block hashes: its
    first block's hash picks it, so every prompt sharing a first block (a prefix) goes to one."""
    if replicas <= 1 or not block_hashes:
        return 0
    return int.from_bytes(block_hashes[0][:8], "big") % replicas


def worker_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """One worker's line of ``Cluster.stats()`` from its actor's raw stats."""
    metrics = stats.get("metrics") or {}
    return {
        "role": stats["role"],
        "running": stats["running"],
        "queued": stats["waiting"] + stats["waiting_for_kv"],
        "held_for_transfer": stats["held_for_transfer"],
        "free_blocks": stats["free_blocks"],
        "num_blocks": stats["num_blocks"],
        # KV memory in what it holds: attention tokens and full recurrent states (per pool below)
        "capacity_tokens": stats["capacity"]["tokens"],
        "capacity_recurrent_states": stats["capacity"]["recurrent_states"],
        "kv_pools": stats["capacity"]["pools"],
        "pinned_blocks": stats["pinned_blocks"],
        "explicitly_pinned_blocks": stats["explicitly_pinned_blocks"],
        "hit_rate": stats["hit_rate"],
        "hit_tokens": stats["hit_tokens"],
        "hit_tokens_by_tier": hit_tokens_by_tier(stats),  # cluster.tier_stats
        "host_tier": host_tier_summary(stats),
        "queried_tokens": stats["queried_tokens"],
        "num_preemptions": stats["num_preemptions"],
        "transfer": stats["transfer"],
        "transfer_bytes": int(stats["transfer"].get("bytes", 0)) if isinstance(stats["transfer"], dict) else 0,
        # the worker's transfer series: one entry per KV read it finished (bytes above, same reads)
        "transfers": int(_counter(metrics, "kvfleet_kv_transfers_total")),
        "transfer_seconds": _histogram_sum(metrics, "kvfleet_kv_transfer_seconds"),
        "requests_finished": int(metrics.get("kvfleet_requests_finished_total", 0)),
        "requests_aborted": int(metrics.get("kvfleet_requests_aborted_total", 0)),
    }


def _add_counts(total: dict[str, Any], counts: Mapping[str, Any]) -> None:
    """Add ``counts`` (numbers, or dicts of them, nested) into ``total``."""
    for name, value in counts.items():
        if isinstance(value, Mapping):
            _add_counts(total.setdefault(name, {}), value)
        else:
            total[name] = total.get(name, 0) + value


def _counter(metrics: dict[str, Any], name: str) -> float:
    value = metrics.get(name, 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _histogram_sum(metrics: dict[str, Any], name: str) -> float:
    value = metrics.get(name)
    return float(value.get("sum", 0.0)) if isinstance(value, dict) else 0.0


async def probe(handle: WorkerHandle, timeout_s: float, renew: list[str] | None = None) -> str:
    """A worker's health: "ok", or why not (a dead actor, a stopped engine, no answer in time).
    ``renew``: the request ids whose leases the call renews there."""
    try:
        await asyncio.wait_for(await_ref(handle.health.remote(renew)), timeout_s)
        return "ok"
    except TimeoutError:
        return f"did not answer a health check within {timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001  (whatever the failure, it is the verdict)
        return describe_failure(exc)


def describe_failure(exc: BaseException) -> str:
    """One line saying why a worker call failed (a dead actor, a stopped engine, ...)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}".strip()


def _worker_class(role: WorkerRole) -> ActorClass[PrefillWorker] | ActorClass[DecodeWorker]:
    """The worker actor class for ``role``, as what ``@ray.remote`` made of it (a cast: mypy does
    not see what a class decorator returns)."""
    from actors.worker import DecodeWorker, PrefillWorker

    if role == "prefill":
        return cast("ActorClass[PrefillWorker]", PrefillWorker)
    return cast("ActorClass[DecodeWorker]", DecodeWorker)


def _kill(handle: WorkerHandle) -> None:
    import ray

    if ray.is_initialized():  # never start a Ray just to kill an actor of one that is gone
        ray.kill(handle, no_restart=True)


async def await_ref(ref: ObjectRef[T]) -> T:
    """A Ray object ref as a coroutine (for ``asyncio.wait_for`` / ``gather``)."""
    return await ref
