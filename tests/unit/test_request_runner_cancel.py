"""``RequestRunner.run`` under a caller cancelled twice, as anyio's cancel scopes do under
Starlette's streaming responses when a client disconnects: the request is aborted on its workers
and the attempt's error (Ray Serve cancels the worker calls of a disconnected request) is taken,
so asyncio reports no "Task exception was never retrieved". No Ray cluster: the attempt and the
worker are fakes."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from cluster.in_flight import ClusterRequest, InFlight
from cluster.request_runner import RequestRunner
from cluster.results import ClusterCompletion, Delta
from configs import load_config
from engine.sampling_params import SamplingParams
from engine.validation import ValidatedPrompt


class AttemptCancelledByRay(Exception):
    """Stands in for ``ray.exceptions.TaskCancelledError`` of a worker call."""


class StuckRunner(RequestRunner):
    """A runner whose attempt waits for ``release``, then fails as a cancelled worker call does."""

    def __init__(self) -> None:
        super().__init__(load_config("tiny"), SimpleNamespace(), InFlight())  # type: ignore[arg-type]
        self.release = asyncio.Event()

    async def collect(
        self, request: ClusterRequest, on_delta: Callable[[Delta], None] | None = None
    ) -> ClusterCompletion:
        await self.release.wait()
        raise AttemptCancelledByRay(request.request_id)


def test_a_caller_cancelled_twice_aborts_and_leaves_no_unretrieved_task_error() -> None:
    reported: list[dict[str, Any]] = []
    aborted: list[str] = []

    async def abort(engine_id: str) -> None:
        aborted.append(engine_id)
        await asyncio.sleep(0.05)

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context))
        runner = StuckRunner()
        request = ClusterRequest("req-1", ValidatedPrompt((1, 2, 3)), SamplingParams(max_tokens=4))
        request.on("decode-0", SimpleNamespace(abort=SimpleNamespace(remote=abort)))  # type: ignore[arg-type]
        caller = asyncio.ensure_future(runner.run(request))
        await asyncio.sleep(0.01)  # the caller waits on the attempt
        caller.cancel()
        await asyncio.sleep(0.01)  # the caller waits on the abort
        caller.cancel()  # cancelled again while it cleans up
        await asyncio.gather(caller, return_exceptions=True)
        assert caller.cancelled()
        assert request.aborted and aborted == ["req-1"]
        runner.release.set()  # the attempt ends now, in an error nobody awaits
        await asyncio.sleep(0.1)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    gc.collect()
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported
