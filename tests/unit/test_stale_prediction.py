"""A request whose predicted hit was evicted before it reached its worker (the worker answers
``STALE_PREDICTION`` and runs nothing) is routed again under a fresh id, after the router applied
the worker's report; the attempt it finally runs under found what its decision predicted. After
``MAX_STALE_ROUTES`` such answers the last attempt runs on whatever hit it finds. No Ray cluster:
the router and the workers are fakes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from actors.worker_types import STALE_PREDICTION, ExpectedHit, TokenChunk
from cluster.in_flight import ClusterRequest, InFlight
from cluster.request_runner import MAX_STALE_ROUTES, RequestRunner
from configs import load_config
from engine.routing import Decision
from engine.sampling_params import SamplingParams
from engine.validation import ValidatedPrompt

PROMPT = tuple(range(1, 40))


class FakeWorker:
    """Answers ``complete`` calls as ``EngineWorker`` does: ``STALE_PREDICTION`` to a strict
    expectation while ``stale`` > 0 (its hit is gone), else one token with the hit it found (the
    expected one, or 0 where it is gone)."""

    def __init__(self, stale: int) -> None:
        self.stale = stale
        self.calls: list[tuple[str, ExpectedHit | None]] = []
        self.complete = SimpleNamespace(remote=self._complete)
        self.abort = SimpleNamespace(remote=lambda _rid: None)

    async def _complete(
        self, request_id: str, *args: Any, expected: ExpectedHit | None = None, **kw: Any
    ) -> TokenChunk:
        self.calls.append((request_id, expected))
        gone = self.stale > 0
        self.stale -= 1
        if gone and expected is not None and expected.strict:
            return TokenChunk([], True, STALE_PREDICTION, router_ack=(acked(),))  # type: ignore[arg-type]
        found = expected.num_tokens if expected is not None and not gone else 0
        return TokenChunk([7], True, "length", num_cached_tokens=found)


applied: list[int] = []


async def acked() -> None:
    applied.append(1)


class FakeRouterRunner(RequestRunner):
    """A runner whose router predicts 32 cached tokens on ``w0`` every time it is asked."""

    def __init__(self, worker: FakeWorker) -> None:
        supervisor = SimpleNamespace(infos={"w0": None}, workers={"w0": worker}, lost={})
        super().__init__(load_config("tiny"), supervisor, InFlight())  # type: ignore[arg-type]
        tokenizer = SimpleNamespace(decode=lambda ids, **_: "x" * len(ids))
        self.model = SimpleNamespace(  # type: ignore[assignment]
            tokenizer=tokenizer, hash_block_size=4, eos_token_id=None, prompt_text=lambda _prompt: ""
        )
        self.asked: list[str] = []

    async def _ask_router(
        self, request_id: str, hashes: list[bytes], num_tokens: int, max_tokens: int | None = None
    ) -> Decision:
        self.asked.append(request_id)
        return Decision("w0", "w0", 32, num_tokens, reason="prefix")

    def _note_finished(self, ttft_s: float, num_out: int, ok: bool) -> None:
        pass


def run(stale: int) -> tuple[FakeRouterRunner, FakeWorker, Any]:
    worker = FakeWorker(stale)
    runner = FakeRouterRunner(worker)
    request = ClusterRequest("req", ValidatedPrompt(PROMPT), SamplingParams(max_tokens=1, ignore_eos=True))
    applied.clear()
    completion = asyncio.run(runner.collect(request))
    return runner, worker, completion


def test_a_stale_prediction_is_routed_again_after_the_router_has_the_evictions() -> None:
    runner, worker, completion = run(stale=1)
    assert runner.asked == ["req", "req#retry1"]  # routed again, under a fresh engine id
    assert [rid for rid, _ in worker.calls] == ["req", "req#retry1"]
    assert all(expected is not None and expected.strict for _, expected in worker.calls)
    assert applied == [1]  # the worker's report was awaited before the second route
    assert completion.predicted_hit == completion.cached_tokens == 32  # no false hit
    assert completion.token_ids == [7]


def test_the_last_attempt_after_repeated_stale_predictions_runs_on_what_it_finds() -> None:
    _runner, worker, completion = run(stale=MAX_STALE_ROUTES + 5)
    assert len(worker.calls) == MAX_STALE_ROUTES + 1
    strict = [expected.strict for _, expected in worker.calls if expected is not None]
    assert strict == [True] * MAX_STALE_ROUTES + [False]
    assert completion.cached_tokens == 0 < completion.predicted_hit  # the false hit it then takes
