"""What a worker reports to the router as its load (``WorkerView.load``): the prompt tokens of
the step being computed still count as tokens to compute, so a router asking during a long
prefill step sees that worker busy (the scheduler advances a request when it schedules it)."""

from __future__ import annotations

from configs import load_config
from engine.core import EngineCore
from engine.sampling_params import SamplingParams


def test_the_step_being_computed_counts_in_the_reported_queue() -> None:
    engine = EngineCore(load_config("tiny", ["scheduler.prefill_chunk_size=64"]))
    prompt = list(range(3, 103))  # 100 tokens: chunks of 64 and 36
    engine.add_request("a", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.worker_view.load()[0] == 100.0  # waiting
    during: list[float] = []
    engine.on_scheduled = lambda: during.append(engine.worker_view.load()[0])
    engine.step()
    # the first chunk (64) is being computed; of the 36 behind it a running request counts all but
    # its last token (the one it samples)
    assert during == [64.0 + 35.0]
    assert engine.worker_view.load()[0] == 35.0  # between steps: only what is left
    engine.step()
    assert during == [99.0, 36.0]
    assert engine.worker_view.load()[0] == 0.0
    engine.step()  # a decode step: one token per request, not a prompt chunk
    assert during[-1] == 0.0 and engine.worker_view.load()[0] == 0.0
