"""The requests a driver has in flight: each one's current attempt (which workers it waits on,
under which engine id) and the registry the request runner and the supervisor share, the runner
to add and remove requests, the supervisor to renew their leases and cut them loose from a
worker it lost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from engine.validation import ValidatedPrompt

if TYPE_CHECKING:
    from cluster.request_runner import ClusterCompletion
    from cluster.supervisor import WorkerHandle


@dataclass
class ClusterRequest:
    """One request of the driver API, checked at its entry point (``prompt``: its token ids, its
    text when given as text, its cache salt), and its current attempt."""

    request_id: str
    prompt: ValidatedPrompt
    sampling: SamplingParams
    submitted: float = field(default_factory=time.monotonic)
    workers: list[WorkerHandle] = field(default_factory=list)
    worker_ids: list[str] = field(default_factory=list)  # where the current attempt waits
    aborted: bool = False
    attempt: int = 0
    streamed: bool = False  # the current attempt delivered output tokens
    task: asyncio.Task[ClusterCompletion] | None = None  # the current attempt
    lost_worker: str | None = None  # the worker the current attempt was cut loose from

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
