"""Start and stop the HTTP API on Ray Serve: what ``kvfleet serve`` runs.

``start_serving(config)`` connects to Ray (an embedded local cluster sized for the workers and
the ingress replicas, or ``ray.address``), starts Serve without its HTTP proxy and deploys the
application with direct ingress replicas (``serving.app.DirectIngress``): each serves HTTP itself
on ``serve.host:serve.port`` of this node (``serving.http_server``), so a request reaches the
process that drives the cluster with no proxy hop. It returns once every deployment is running
(the workers have loaded the model, the port accepts connections). ``stop_serving`` deletes the
application, which drains it: ingress replicas stop accepting and finish their in-flight requests
(up to ``serve.graceful_shutdown_timeout_s``), the controller waits for idle workers and stops
them; then Serve (and an embedded Ray) shut down.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from configs import ClusterConfig

log = logging.getLogger(__name__)
# The serving lifecycle (ready, draining, stopped) is what an operator watches for after the URL
# line: WARNING shows it under every preset (the tiny ones log at WARNING) and hides it only
# where the config asks for errors alone.
LIFECYCLE = logging.WARNING


@dataclass
class Serving:
    """A running application: its base URL and whether this process started Ray."""

    url: str
    owns_ray: bool
    started_s: float


def start_serving(config: ClusterConfig) -> Serving:
    import ray
    from ray import serve

    from cluster.placement import embedded_init_kwargs, loopback_environment
    from serving.app import APP_NAME, kvfleet_app, serve_logging

    loopback_environment()
    started = time.monotonic()
    owns_ray = False
    if not ray.is_initialized():
        if config.ray.address:
            ray.init(address=config.ray.address, namespace=config.ray.namespace)
        else:
            kwargs = embedded_init_kwargs(config)
            ingress_cpus = config.serve.ingress_replicas * config.serve.ingress_num_cpus
            kwargs["num_cpus"] = int(-(-(kwargs["num_cpus"] + ingress_cpus) // 1))
            ray.init(**kwargs)
            owns_ray = True
    try:
        serve.start(proxy_location="Disabled", logging_config=serve_logging(config))
        node = f"node:{ray.util.get_node_ip_address()}"  # the ingress opens the port on this node
        serve.run(
            kvfleet_app(config, direct=True, node_resource=node), name=APP_NAME, route_prefix=None, blocking=False
        )
    except BaseException:
        stop_serving(owns_ray)
        raise
    host = config.serve.host if config.serve.host not in ("0.0.0.0", "::") else "127.0.0.1"
    return Serving(f"http://{host}:{config.serve.port}", owns_ray, time.monotonic() - started)


def stop_serving(owns_ray: bool) -> None:
    """Drain and delete the application, stop Serve, and stop Ray if this process started it."""
    import ray
    from ray import serve

    from serving.app import APP_NAME

    if ray.is_initialized():
        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        except Exception as exc:  # noqa: BLE001 - shutdown is best effort; Ray is shut down next
            log.warning("serve shutdown: %s", exc)
    if owns_ray and ray.is_initialized():
        ray.shutdown()


def serve_until_signalled(config: ClusterConfig) -> int:
    """``kvfleet serve``: start, print the URL, serve until SIGINT / SIGTERM, drain, stop."""
    import signal

    serving = start_serving(config)  # Ctrl-C while starting: KeyboardInterrupt, cleaned up there
    stop = threading.Event()
    # after ray.init, which installs a SIGTERM handler of its own that exits at once
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    model = config.serve.served_model_name or config.model.source
    print(f"kvfleet: serving {model} at {serving.url} (OpenAI API under {serving.url}/v1)", flush=True)
    log.log(LIFECYCLE, "ready in %.1f s; Ctrl-C (SIGINT) or SIGTERM drains and stops", serving.started_s)
    try:
        while not stop.wait(0.5):
            pass
        log.log(LIFECYCLE, "draining in-flight requests (up to %.0f s)", config.serve.graceful_shutdown_timeout_s)
    finally:
        stop_serving(serving.owns_ray)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.log(LIFECYCLE, "stopped")
    return 0
