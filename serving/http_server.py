"""The ingress replica's own HTTP server: ``build_api``'s app on ``serve.host:serve.port``, served
by uvicorn inside the replica's event loop, with no Ray Serve proxy in front.

Through Serve's proxy a request crosses two processes before it reaches the API (the proxy, then
the replica, called over Ray, which fetches the body back from the proxy), and the answer
crosses them again: half the HTTP latency of a one-token completion on the ``tiny`` preset
(``benchmarks/ingress_bench.py``). Here the replica that runs the driver accepts the connection
itself, as vLLM's API server runs in the process of its engine client. ``kvfleet serve`` deploys
its ingress replicas this way (``serving.app.kvfleet_app(..., direct=True)``) and starts Serve
with no proxy; the RayService keeps Serve's proxy, which KubeRay's Service and probes expect.

Every replica binds the port with ``SO_REUSEPORT``, so several on one node share it and the
kernel spreads connections over them. Draining: ``stop`` closes the listener, lets the requests
in flight finish (streams included) for up to the graceful-shutdown timeout, then cancels what
is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

BACKLOG = 2048
STARTUP_TIMEOUT_S = 30.0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that other processes may bind too
    (``SO_REUSEPORT``: the kernel balances connections over them); OSError if the port is held
    by a socket without it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the replica's process belongs to Ray, and
    the replica stops when Serve deletes it (``HTTPServer.stop``)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HTTPServer:
    """One uvicorn server serving an ASGI app on a socket of its own, in the running event loop.

    Invariants: after ``start`` returns the socket accepts connections; ``stop`` runs once
    (later calls wait for the first) and ends with the server task finished."""

    def __init__(self, app: Any, host: str, port: int, *, graceful_timeout_s: float, access_log: bool):
        self.host, self.port = host, port
        self._app = app
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,  # kvfleet's logging (configs.logs) stays as it is
            access_log=access_log,
            timeout_graceful_shutdown=max(1, int(graceful_timeout_s)),
            timeout_keep_alive=30,
            backlog=BACKLOG,
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None  # the one stop, once asked

    async def start(self) -> None:
        """Bind and serve; returns once the server accepts connections (OSError: port held)."""
        sock = bind(self.host, self.port)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise RuntimeError(f"the HTTP server on {self.host}:{self.port} stopped while starting")
            if loop.time() > deadline:
                raise TimeoutError(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        """Stop accepting, finish the requests in flight (up to the graceful timeout), stop."""
        if self._task is None:
            return
        if self._stopping is None:
            self._server.should_exit = True
            self._stopping = asyncio.ensure_future(self._finish(self._task))
        await asyncio.shield(self._stopping)

    @staticmethod
    async def _finish(task: asyncio.Task[None]) -> None:
        try:
            await task
        except Exception as exc:  # noqa: BLE001 - stopping: how the server ended is only logged
            log.warning("the HTTP server ended with %s", exc)
