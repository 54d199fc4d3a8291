"""The requests a driver has in flight: each one's current attempt (which workers it waits on,
under which engine id) and the registry the request runner and the supervisor share, the runner
to add and remove requests, the supervisor to renew their leases and cut them loose from a
worker it lost; and the placements requests in flight share by key (``SharedPlacements``: the
samples of one prompt run where the first of them was routed)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from engine.validation import ValidatedPrompt

if TYPE_CHECKING:
    from cluster.handles import WorkerHandle
    from cluster.results import ClusterCompletion
    from engine.routing import Decision


@dataclass
class ClusterRequest:
    """One request of the driver API, checked at its entry point (``prompt``: its token ids, its
    text when given as text, its cache salt), and its current attempt. ``share_placement``: a key
    whose requests in flight run where the first of them was routed (``SharedPlacements``)."""

    request_id: str
    prompt: ValidatedPrompt
    sampling: SamplingParams
    submitted: float = field(default_factory=time.monotonic)
    workers: list[WorkerHandle] = field(default_factory=list)
    worker_ids: list[str] = field(default_factory=list)  # where the current attempt waits
    aborted: bool = False
    attempt: int = 0
    stale_routes: int = 0  # attempts sent back unrun: the router's predicted hit was gone on arrival
    streamed: bool = False  # the current attempt delivered output tokens
    task: asyncio.Task[ClusterCompletion] | None = None  # the current attempt
    lost_worker: str | None = None  # the worker the current attempt was cut loose from
    share_placement: str | None = None

    @property
    def token_ids(self) -> list[int]:
        """The prompt's token ids, as the workers take them."""
        return list(self.prompt.token_ids)

    @property
    def engine_id(self) -> str:
        """The id the workers know this attempt by (a retry must not meet its first try's state)."""
        return self.request_id if not self.attempt else f"{self.request_id}#retry{self.attempt}"

    def on(self, worker_id: str, handle: WorkerHandle, *more: tuple[str, WorkerHandle]) -> None:
        """The current attempt now waits on this worker (and on ``more`` (id, handle) pairs)."""
        self.workers = [handle, *(h for _, h in more)]
        self.worker_ids = [worker_id, *(w for w, _ in more)]

    def cut_loose(self, worker_id: str) -> None:
        """The worker this attempt waits on is lost: stop waiting (the runner decides what next)."""
        if self.task is not None and not self.task.done() and self.lost_worker is None:
            self.lost_worker = worker_id
            self.task.get_loop().call_soon_threadsafe(self.task.cancel)


class InFlight:
    """Owns the driver's requests in flight, by request id.

    Invariants: a request id is here from the start of its first attempt until its last
    attempt ended; two requests in flight never share an id."""

    def __init__(self) -> None:
        self._requests: dict[str, ClusterRequest] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[ClusterRequest]:
        return iter(list(self._requests.values()))  # a copy: other threads add and remove

    def get(self, request_id: str) -> ClusterRequest | None:
        return self._requests.get(request_id)

    def add(self, request: ClusterRequest) -> None:
        self._requests[request.request_id] = request

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def leases(self, worker_ids: Iterable[str]) -> dict[str, list[str]]:
        """Per worker: the engine ids of the attempts that wait on it (whose leases to renew)."""
        renew: dict[str, list[str]] = {worker_id: [] for worker_id in worker_ids}
        for request in self:
            for worker_id in request.worker_ids:
                if worker_id in renew:
                    renew[worker_id].append(request.engine_id)
        return renew

    def cut_loose(self, worker_id: str) -> None:
        """Cut every attempt waiting on a lost worker loose from it."""
        for request in self:
            if worker_id in request.worker_ids:
                request.cut_loose(worker_id)


class NoSharedDecision(Exception):
    """The request that was to route a shared placement ended without a decision (cancelled, or
    failed before the router answered): whoever waited on it routes on its own."""


class SharedPlacements:
    """Owns the placements requests in flight share by key: the first request of a key that
    routes decides, and every request of that key in flight meanwhile or later takes its
    decision instead of asking the router (``n`` samples of one prompt then share the prompt's
    KV on one decode worker through its prefix cache).

    Invariants: a key is here exactly while a request that joined it is in flight (``join`` /
    ``leave`` pair up); a key has one decision future, resolved once, with a ``Decision`` or
    with ``NoSharedDecision`` (then the next request of the key to route decides anew). Safe to
    use from several threads and event loops (the futures are ``concurrent.futures`` ones)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, int] = {}
        self._decisions: dict[str, concurrent.futures.Future[Decision]] = {}

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._members

    def join(self, key: str) -> None:
        """A request of ``key`` is in flight from now on."""
        with self._lock:
            self._members[key] = self._members.get(key, 0) + 1

    def leave(self, key: str) -> None:
        """A request of ``key`` ended; the key's decision goes with its last request."""
        with self._lock:
            left = self._members[key] - 1
            if left:
                self._members[key] = left
                return
            del self._members[key]
            future = self._decisions.pop(key, None)
            if future is not None and not future.done():  # its decider is still unwinding
                future.set_exception(NoSharedDecision(key))

    def claim(self, key: str) -> tuple[concurrent.futures.Future[Decision], bool]:
        """The future of ``key``'s decision, and whether the caller decides it (it must then
        resolve it: ``decided`` or ``abandon``); the others await it."""
        with self._lock:
            assert key in self._members, "a request joins its key before it routes"
            future = self._decisions.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                return future, False
            future = concurrent.futures.Future()
            self._decisions[key] = future
            return future, True

    def decided(self, future: concurrent.futures.Future[Decision], decision: Decision) -> None:
        with self._lock:
            if not future.done():
                future.set_result(decision)

    def abandon(self, future: concurrent.futures.Future[Decision]) -> None:
        """The decider ended without a decision: the requests waiting route on their own."""
        with self._lock:
            if not future.done():
                future.set_exception(NoSharedDecision())
