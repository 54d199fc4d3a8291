"""Starting, attaching to and stopping the cluster, for ``cluster.api.Cluster`` (split out of it,
not used alone): connect to Ray or start it, start the prefill/decode worker actors and the router
actor, check the workers share one KV layout and load the tokenizer, warm the decode workers'
transfer connections, and run the driver's event loop thread that the blocking calls wait on
(``_sync``). ``ClusterHandles`` / ``Cluster.attach`` let another process drive a started cluster.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from configs import ClusterConfig

if TYPE_CHECKING:
    from cluster.api import Cluster

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ClusterHandles:
    """Everything another process needs to drive a started cluster (picklable): the config, the
    worker and router actor handles, what each worker reported at start, the model directory.
    The process that started the actors owns them; ``Cluster.attach`` only drives them."""

    config: ClusterConfig
    workers: dict[str, Any]
    infos: dict[str, Any]
    router: Any
    model_directory: str


class ClusterLifecycle:
    """Starts, attaches and stops ``Cluster`` (state: the cluster's config, worker and router
    handles, worker infos, tokenizer and driver event loop, all set up in ``Cluster.__init__``).

    Invariants: ``start`` either leaves a started cluster (every worker registered with the
    router, the event loop running, supervision on) or shuts down what it began and raises;
    ``shutdown`` is idempotent and stops actors and Ray only where this process started them.
    Listed before ``ClusterAdmin`` in ``Cluster``'s bases: its ``_sync`` is the one
    ``ClusterAdmin`` declares.
    """

    config: ClusterConfig
    start_timeout_s: float
    workers: dict[str, Any]
    infos: dict[str, Any]
    router: Any
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    model_directory: str
    _hash_block_size: int
    _owns_ray: bool
    _owns_actors: bool
    _loop: asyncio.AbstractEventLoop | None
    _loop_thread: threading.Thread | None
    _started: bool

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> Self:
        """Connect to Ray (or start it), start the workers and the router; wait until ready."""
        if self._started:
            return self
        import ray

        from actors.router import Router
        from actors.worker import DecodeWorker, PrefillWorker
        from cluster.placement import (
            ROUTER_NUM_CPUS,
            check_capacity,
            embedded_init_kwargs,
            loopback_environment,
            worker_options,
        )
        from engine.core import resolve_model_directory

        config = self.config
        loopback_environment()
        if not ray.is_initialized():
            if config.ray.address:
                ray.init(address=config.ray.address, namespace=config.ray.namespace)
            else:
                ray.init(**embedded_init_kwargs(config))
                self._owns_ray = True
        try:
            resources = ray.cluster_resources()
            check_capacity(config, resources)
            model_directory = resolve_model_directory(config)  # built/converted once, here
            disaggregated = config.workers.num_prefill > 0
            for i in range(config.workers.num_prefill):
                options = worker_options(config, "prefill", resources)
                self.workers[f"prefill-{i}"] = PrefillWorker.options(**options).remote(config, f"prefill-{i}", True)
            for i in range(config.workers.num_decode):
                options = worker_options(config, "decode", resources)
                self.workers[f"decode-{i}"] = DecodeWorker.options(**options).remote(
                    config, f"decode-{i}", disaggregated
                )
            infos = self._wait_ready({wid: w.info.remote() for wid, w in self.workers.items()})
            self._adopt(infos, str(model_directory))
            first = next(iter(infos.values()))
            # Ray restarts a router that dies; this process then registers the workers with it again
            self.router = Router.options(num_cpus=ROUTER_NUM_CPUS, max_restarts=-1).remote(
                config, first.groups, uuid.uuid4().hex
            )
            ray.get(self.router.ready.remote(), timeout=120)
            ray.get([
                self.router.add_worker.remote(wid, info.router_role, info.num_blocks, self.workers[wid])
                for wid, info in infos.items()
            ])  # fmt: skip
            ray.get([w.set_router.remote(self.router) for w in self.workers.values()], timeout=120)
            self._warm_connections(infos)
            self._start_loop()
            self._started = True
            self._start_supervision()
            for pin in config.router.pins:
                self.pin_prefix(pin.text if pin.text is not None else list(pin.token_ids or []), pin.replicas,
                                pin.ttl_s, wait=False)  # fmt: skip
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "cluster ready: %d prefill + %d decode workers, router policy %s, %s",
            config.workers.num_prefill, config.workers.num_decode, config.router.policy, config.model.source,
        )  # fmt: skip
        return self

    def _warm_connections(self, infos: dict[str, Any]) -> None:
        """Have every decode worker open its transfer connection to every prefill worker now, so
        no request's first read pays the setup (a worker that joins later is warmed when a
        decode worker first hears of it with a request)."""
        import ray

        agents = [info.agent for info in infos.values() if info.role == "prefill" and info.agent is not None]
        decoders = [self.workers[w] for w, info in infos.items() if info.role == "decode" and info.agent is not None]
        if agents and decoders:
            ray.get([d.warm_peers.remote(agents) for d in decoders], timeout=120)

    def _adopt(self, infos: dict[str, Any], model_directory: str) -> None:
        """Take the started workers' reports: check they share one KV layout, load the tokenizer."""
        from engine.kv_cache.spec import hash_block_size
        from engine.tokenizer import load_tokenizer

        self.infos = dict(infos)
        self.model_directory = model_directory
        first = next(iter(infos.values()))
        for info in infos.values():
            if info.groups != first.groups or info.block_size != first.block_size:
                raise RuntimeError(f"{info.worker_id}: KV layout differs from {first.worker_id}'s")
        self.max_model_len = min(info.max_model_len for info in infos.values())
        self.vocab_size = first.vocab_size
        self._hash_block_size = hash_block_size(list(first.groups))
        self.tokenizer = load_tokenizer(Path(model_directory), first.vocab_size)

    def handles(self) -> ClusterHandles:
        """What ``Cluster.attach`` needs to drive this cluster from another process."""
        self._require_started()
        return ClusterHandles(self.config, dict(self.workers), dict(self.infos), self.router, self.model_directory)

    @classmethod
    def attach(cls, handles: ClusterHandles) -> Cluster:
        """Drive a cluster another process started (its actors stay that process's: ``shutdown``
        here stops only this driver, never the actors or Ray)."""
        cluster = cls(handles.config)
        cluster._owns_actors = False
        cluster.workers = dict(handles.workers)
        cluster.router = handles.router
        cluster._adopt(handles.infos, handles.model_directory)
        cluster._start_loop()
        cluster._started = True
        cluster._start_supervision()
        return cluster

    def _wait_ready(self, refs: dict[str, Any]) -> dict[str, Any]:
        import ray

        pending = list(refs.values())
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=self.start_timeout_s)
        if pending:
            waiting = [wid for wid, ref in refs.items() if ref in pending]
            raise TimeoutError(
                f"workers {waiting} not ready after {self.start_timeout_s:.0f} s (not enough Ray resources, "
                f"or the model is still loading); available: {ray.available_resources()}"
            )
        return {wid: ray.get(ref) for wid, ref in refs.items()}

    def shutdown(self) -> None:
        """Stop the workers and the router (and the embedded Ray, if started here). Idempotent."""
        import ray

        self._stop_supervision()
        if ray.is_initialized() and self._owns_actors:
            if self.workers:
                refs = [w.shutdown.remote() for w in self.workers.values()]
                try:
                    ray.wait(refs, num_returns=len(refs), timeout=30)
                except Exception as exc:  # dead actors: nothing to stop
                    log.debug("worker shutdown: %s", exc)
            for handle in [*self.workers.values(), self.router]:
                if handle is not None:
                    try:
                        ray.kill(handle)
                    except Exception as exc:
                        log.debug("kill: %s", exc)
        self.workers.clear()
        self.router = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(10)
            self._loop.close()
            self._loop = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False
        self._started = False

    def _start_loop(self) -> None:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="kvfleet-driver", daemon=True)
        thread.start()
        self._loop, self._loop_thread = loop, thread

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("cluster: not started (use `with Cluster(...)` or call start())")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
