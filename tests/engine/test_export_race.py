"""A KV handle must not leave a CUDA prefill engine before the KV it names is written.

A prefill-only step samples nothing, so nothing in it waits for the GPU: the step returns while
the forward's KV writes are still queued on the compute stream. A reader copies the handle's
pages by DMA (NIXL, CUDA IPC), which is not ordered after that stream. Here the stream is delayed
by a sleep kernel queued before the forward (the eager one, or the replay of a captured step's
graphs), and the "reader" snapshots the pages on another
stream as soon as the handle is out. With the engine's fence (``ModelRunner.wait_kv_written``)
the snapshot equals the final KV; with the fence removed the same test sees stale pages, which
proves it can catch the race.
"""

from __future__ import annotations

import pytest
import torch

from configs import load_config
from engine.core import EngineCore
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the race is a GPU stream race)")

#: GPU clock cycles the compute stream sleeps before each forward (~0.3 s on a 2 GHz SM)
DELAY_CYCLES = 600_000_000
PROMPT = list(range(3, 3 + 77))  # 76 tokens prefilled: several 16-token blocks


def prefill_engine(monkeypatch: pytest.MonkeyPatch) -> EngineCore:
    config = load_config("tiny", ["transfer.backend=local", "model.device=cuda", "model.dtype=float32"])
    engine = EngineCore(config, kv_role="prefill", name="race-prefill")
    model = engine.runner.model
    forward = model.forward

    def delayed(batch):
        torch.cuda._sleep(DELAY_CYCLES)
        return forward(batch)

    monkeypatch.setattr(model, "forward", delayed)
    mixed = engine.runner.mixed
    if mixed is not None:  # a captured prefill step replays graphs instead of calling forward
        index = mixed.index

        def index_then_delay(*args, **kwargs):
            built = index(*args, **kwargs)  # after the step's upload, before the graphs replay
            torch.cuda._sleep(DELAY_CYCLES)
            return built

        monkeypatch.setattr(mixed, "index", index_then_delay)
    return engine


def pages_seen_by_reader(engine: EngineCore) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run the prefill until its handle is out; then copy every slot on a side stream at once (the
    reader's view) and, after a full synchronize, again (the truth)."""
    engine.add_request("r0", PROMPT, SamplingParams(max_tokens=1), prefill_only=True)
    handle = None
    for _ in range(20):
        for result in engine.step():
            if result.kv_handle is not None:
                handle = result.kv_handle
        if handle is not None:
            break
    assert handle is not None, "the prefill never produced a handle"
    reader = torch.cuda.Stream()  # non-blocking: not ordered after the compute stream
    with torch.cuda.stream(reader):
        seen = [slot.clone() for slot in engine.runner.slots]
    reader.synchronize()
    torch.cuda.synchronize()
    truth = [slot.clone() for slot in engine.runner.slots]
    engine.close()
    return seen, truth


def test_handle_leaves_only_after_its_kv_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    seen, truth = pages_seen_by_reader(prefill_engine(monkeypatch))
    assert any(bool(t.any()) for t in truth), "the prefill wrote no KV"
    for s, t in zip(seen, truth, strict=True):
        assert torch.equal(s, t)


def test_without_the_fence_the_reader_sees_stale_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run with ``wait_kv_written`` disabled: the reader's copy misses KV (the race the
    fence closes), so the test above would fail without the fix."""
    engine = prefill_engine(monkeypatch)
    monkeypatch.setattr(engine.runner, "wait_kv_written", lambda: None)
    seen, truth = pages_seen_by_reader(engine)
    assert any(not torch.equal(s, t) for s, t in zip(seen, truth, strict=True))
