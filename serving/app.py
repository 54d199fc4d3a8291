"""The Ray Serve application: ``serve run serving.app:build_app config=<preset or path>``.

Two deployments:

* ``KvfleetController`` (one replica, no CPU of its own) starts the cluster exactly as
  ``Cluster`` does (router actors, prefill and decode worker actors) and owns them: when Serve
  stops it, it waits for the workers to go idle (up to the graceful-shutdown timeout) and stops
  them.
* ``KvfleetIngress`` (``serve.ingress_replicas`` replicas) serves the OpenAI-compatible API. Each
  replica attaches a driver to the controller's actors (``Cluster.attach``): the same request
  path as the driver API, with the tokenizer and the detokenizer in the ingress process.

Two ways in: behind Ray Serve's HTTP proxy (``kvfleet_app(config)``: the replica is a Serve ASGI
ingress; ``serve run`` and the RayService) or direct (``kvfleet_app(config, direct=True)``: each
replica serves HTTP itself on ``serve.host:serve.port``, ``serving.http_server``, and Serve runs
no proxy; ``kvfleet serve``). The API is the same app (``serving.api.build_api``) either way.

Arguments (``serve run ... key=value``, or ``args`` in a RayService's serveConfigV2):
``config`` (preset name or YAML path; default ``local``) and ``overrides`` (a list of
``a.b=c``, or one string of them separated by commas or spaces).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.schema import LoggingConfig

from cluster.api import Cluster, ClusterHandles
from configs import ClusterConfig, load_config

log = logging.getLogger(__name__)

APP_NAME = "kvfleet"
CONTROLLER = "KvfleetController"
INGRESS = "KvfleetIngress"
IDLE_POLL_S = 0.2
HEADROOM_REQUESTS = 64  # /health, /metrics and admin calls beyond the queue bound


class ClusterController:
    """Owns the cluster's router and worker actors for the application's lifetime.

    Invariants: the cluster is started before the replica reports ready; ``handles()`` always
    names the actors this replica started; stopping waits for idle workers, then kills them.
    """

    def __init__(self, config: ClusterConfig):
        from configs.logs import setup_logging

        setup_logging(config.logging)
        self.config = config
        self.cluster = Cluster(config).start()

    def handles(self) -> ClusterHandles:
        return self.cluster.handles()

    async def check_health(self) -> None:
        """Serve's health check: a router replica must answer (the others route while one
        restarts; workers are checked by /health)."""
        routers = self.cluster.routers
        for router in routers[:-1]:
            try:
                await router.ready.remote()
                return
            except Exception as exc:  # noqa: BLE001 - this replica is restarting: ask the next
                log.warning("router replica did not answer the health check (%s)", exc)
        await routers[-1].ready.remote()

    def __del__(self) -> None:
        cluster = getattr(self, "cluster", None)
        if cluster is None:
            return
        deadline = time.monotonic() + self.config.serve.graceful_shutdown_timeout_s
        while time.monotonic() < deadline:
            try:
                totals = cluster.stats()["totals"]
            except Exception:  # noqa: BLE001 - no stats (the cluster is going away): stop draining
                break
            if totals["running"] + totals["queued"] == 0:
                break
            time.sleep(IDLE_POLL_S)
        cluster.shutdown()


class OpenAIIngress:
    """One ingress replica: a driver attached to the controller's cluster, serving the API.

    Invariants: the driver is attached once, before the first request is answered; it never
    stops the controller's actors.
    """

    def __init__(self, controller: Any):
        self._controller = controller
        self._cluster: Cluster | None = None
        self._app: Any = None

    async def _attach(self) -> Cluster:
        if self._cluster is None:
            handles: ClusterHandles = await self._controller.handles.remote()
            self._cluster = Cluster.attach(handles)
        return self._cluster

    async def __serve_build_asgi_app__(self) -> Any:
        from serving.api import build_api

        self._app = build_api(await self._attach())
        return self._app

    def __del__(self) -> None:
        if self._cluster is not None:
            self._cluster.shutdown()


class DirectIngress:
    """One ingress replica that serves the API over HTTP itself (``serving.http_server``): a
    driver attached to the controller's cluster and a uvicorn server on ``serve.host:serve.port``
    in this replica's event loop, with no Serve proxy in between.

    Invariants: the replica is ready (its constructor returned) only once the port accepts
    connections; Serve's health check fails once the server stopped; deleting the replica drains
    it (the requests in flight finish, up to ``serve.graceful_shutdown_timeout_s``) before its
    driver stops (the controller's actors are never stopped here).
    """

    # Serve awaits an async constructor (its replica's ``initialize_callable``): the replica is
    # ready only once the port accepts connections
    async def __init__(self, controller: Any):  # type: ignore[misc]
        from serving.api import build_api
        from serving.http_server import HTTPServer

        handles: ClusterHandles = await controller.handles.remote()
        config = handles.config
        self._cluster: Cluster | None = Cluster.attach(handles)
        serve_config = config.serve
        self._server = HTTPServer(
            build_api(self._cluster),
            serve_config.host,
            serve_config.port,
            graceful_timeout_s=serve_config.graceful_shutdown_timeout_s,
            access_log=logging.getLevelName(config.logging.level) <= logging.INFO,
        )
        try:
            await self._server.start()
        except BaseException:
            self._cluster.shutdown()
            self._cluster = None
            raise

    async def check_health(self) -> None:
        if not self._server.running:
            raise RuntimeError(f"the HTTP server on port {self._server.port} stopped")

    async def __del__(self) -> None:
        await self._server.stop()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None


def serve_logging(config: ClusterConfig) -> LoggingConfig:
    """Ray Serve's logging at ``logging.level``: its per-request access lines are INFO records,
    so they show only where kvfleet's own INFO lines do."""
    return LoggingConfig(log_level=config.logging.level)


def kvfleet_app(config: ClusterConfig, *, direct: bool = False, node_resource: str | None = None) -> Application:
    """The application for ``config``: the controller and ``serve.ingress_replicas`` ingresses,
    both logging at ``logging.level`` (``serve_logging``). ``direct``: the ingress replicas serve
    HTTP themselves on ``serve.host:serve.port`` (``DirectIngress``; deploy it on a Serve
    started without a proxy), else they are Serve ASGI ingresses behind Serve's proxy.
    ``node_resource``: a Ray resource only one node has (``node:<ip>``): the ingress replicas
    run there, so the port they open is that node's."""
    serve_config = config.serve
    timeout_s = serve_config.graceful_shutdown_timeout_s
    logging_config = serve_logging(config)
    controller = serve.deployment(
        ClusterController,
        name=CONTROLLER,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=timeout_s + 10,
        health_check_period_s=10,
        health_check_timeout_s=60,
        logging_config=logging_config,
    )
    ingress_options: dict[str, Any] = {"num_cpus": serve_config.ingress_num_cpus}
    if node_resource is not None:
        ingress_options["resources"] = {node_resource: 0.001}
    ingress = serve.deployment(
        DirectIngress if direct else serve.ingress()(OpenAIIngress),
        name=INGRESS,
        num_replicas=serve_config.ingress_replicas,
        ray_actor_options=ingress_options,
        max_ongoing_requests=serve_config.max_queued_requests + HEADROOM_REQUESTS,
        graceful_shutdown_timeout_s=timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
        logging_config=logging_config,
    )
    return ingress.bind(controller.bind(config))  # type: ignore[attr-defined]  # ray's decorator hides .bind


def build_app(args: Mapping[str, Any]) -> Application:
    """``serve run serving.app:build_app config=tiny overrides=workers.num_decode=2``."""
    unknown = set(args) - {"config", "overrides"}
    if unknown:
        raise ValueError(f"build_app: unknown arguments {sorted(unknown)} (expected config, overrides)")
    overrides = args.get("overrides") or []
    if isinstance(overrides, str):
        overrides = [o for o in overrides.replace(",", " ").split() if o]
    return kvfleet_app(load_config(str(args.get("config") or "local"), list(overrides)))
