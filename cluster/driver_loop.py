"""The driver's own event loop: one asyncio loop on a daemon thread that runs every request and
the health loop of a ``Cluster``, so its blocking calls (``generate``, ``stats``, ...) can wait
on coroutines from any thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

NOT_STARTED = "cluster: not started (use `with Cluster(...)` or call start())"


class DriverLoop:
    """Owns one asyncio event loop and the thread that runs it.

    Invariants: the loop and its thread exist together, from ``start`` until ``stop``; a
    coroutine handed over while the loop is stopped is closed and raises "not started".
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._loop is not None

    def start(self) -> None:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="kvfleet-driver", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread

    def stop(self) -> None:
        """Stop the loop and wait (bounded) for its thread; idempotent."""
        if self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop.close()
        self._loop, self._thread = None, None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and block the calling thread until it returns."""
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; its result arrives in the returned future."""
        if self._loop is None:
            coro.close()
            raise RuntimeError(NOT_STARTED)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's own thread (where waiting on it would deadlock)."""
        return self._thread is not None and threading.current_thread() is self._thread
