"""The static token-bucket step of prefill and mixed steps (``engine.model.mixed_step``) against the
eager step.

Oracle: the same preset with ``model.cuda_graphs=false``, which builds and runs every step eagerly
and unpadded (the path the logits tests check against Hugging Face). On the CPU the static step
runs uncaptured from its padded buffers; on CUDA (the ``cuda`` cases, run by
benchmarks/gpu_suite.sh's tests stage) as piecewise graphs split at the mixers. The workload is a
short version of the issue-4 request mix (``benchmarks.support.hf_generate.workload``: every
request added at once, prompts and outputs of mixed lengths), so steps carry prompt chunks beside
decodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from benchmarks.support.hf_generate import workload
from engine.core import EngineCore
from engine.model.mixed_step import MixedStep, StepChunk, token_buckets
from engine.runner import graphs_supported
from engine.sampling_params import SamplingParams
from tests.engine.test_decode_step import run
from tests.model.logits_harness import DEVICES
from tests.support import load_preset

PRESETS = ["tiny", "tiny-hybrid", "tiny-granite-h", "tiny-nemotron-h", "tiny-qwen3-next"]


def engine(preset: str, graphs: bool, device: str, *overrides: str) -> EngineCore:
    return EngineCore(
        load_preset(preset, [f"model.device={device}", f"model.cuda_graphs={str(graphs).lower()}", *overrides])
    )


def short_mix(vocab: int, count: int = 8) -> list[tuple[list[int], int]]:
    """The issue-4 mix (uniform prompt and output lengths, seeded), scaled to the tiny presets:
    prompts of 8-120 tokens (two 64-token prefill chunks at most), 4-16 new tokens."""
    return workload(count, vocab, seed=4, prompt_lens=(8, 120), output_lens=(4, 16))


class MixedSpy:
    """Counts the mixed step's runs: all, padded ones (a pad chunk in the step's batch), and those
    holding both a prompt chunk and a decode (one token past the prompt)."""

    def __init__(self, step: MixedStep):
        self.runs = self.padded = self.mixed = 0
        inner = step.run

        def counted(chunks: Sequence[StepChunk], *rest):  # rest: a launched step's previous ids
            self.runs += 1
            self.mixed += any(c.num_tokens > 1 for c in chunks) and any(c.num_tokens == 1 for c in chunks)
            hidden, batch = inner(chunks, *rest)
            self.padded += len(batch.chunks) > len(chunks)
            return hidden, batch

        step.run = counted  # type: ignore[method-assign]


def test_buckets_cover_every_step_size() -> None:
    assert token_buckets(256, doubling=True) == (16, 32, 64, 128, 256)
    assert token_buckets(8192, doubling=True) == (16, 32, 64, 128, 256, 512, 1024, *range(2048, 8193, 1024))
    assert token_buckets(100, doubling=False) == (16, 32, 48, 64, 80, 96, 100)
    assert token_buckets(10, doubling=True) == (10,)
    for top in (1, 10, 100, 256, 3000):
        for doubling in (True, False):
            buckets = token_buckets(top, doubling)
            assert buckets[-1] == top and all(any(b >= n for b in buckets) for n in range(1, top + 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
def test_mixed_steps_run_static_and_give_the_eager_tokens(preset: str, device: str) -> None:
    """The short issue-4 mix: no step takes the eager forward (``eager_steps`` 0, in the engine's
    stats too), prefill + decode steps are among the static ones, some padded, and the greedy
    tokens are the eager engine's; on CUDA the steps replay captured pieces (uncaptured steps are
    padded here too, ``pad_uncaptured``, so the CPU runs the buckets and the pad chunk)."""
    eager = engine(preset, False, device)
    assert eager.runner.mixed is None
    static = engine(preset, True, device)
    mixed = static.runner.mixed
    assert mixed is not None
    runner = static.runner
    if graphs_supported(static.info.arch, runner.device, runner.paged_attention):  # CUDA, no sparse MoE
        assert mixed.captured, "the piecewise capture fell back (see the log)"
        assert mixed.capture_seconds > 0 and mixed.capture_bytes >= 0
    else:
        assert not mixed.captured
        mixed.pad_uncaptured = True
    spy = MixedSpy(mixed)
    requests = short_mix(eager.info.arch.vocab_size)
    want = run(eager, requests)
    got = run(static, requests)
    assert got == want
    assert static.runner.eager_steps == 0 and static.worker_view.stats()["eager_steps"] == 0
    assert eager.runner.eager_steps > 0 and eager.worker_view.stats()["eager_steps"] == eager.runner.eager_steps
    assert spy.mixed > 0 and spy.padded > 0 and spy.runs >= spy.mixed
    static.close()


def test_pad_chunk_writes_only_null_blocks() -> None:
    """A padded mixed step (a prompt chunk beside decodes) changes KV pages and recurrent states
    only in the null block and the blocks of the requests it runs (one step at a time: no step
    launched while another runs)."""
    core = engine("tiny-hybrid", True, "cpu", "scheduler.async_scheduling=false")
    mixed = core.runner.mixed
    assert mixed is not None
    mixed.pad_uncaptured = True  # the CPU captures nothing: pad as a replayed bucket is
    vocab = core.info.arch.vocab_size
    prompts = [p for p, _ in short_mix(vocab, 3)]
    for i, prompt in enumerate(prompts[:2]):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    running = core.scheduler.running
    while len(running) < 2 or any(r.num_tokens - r.num_computed_tokens != 1 for r in running):
        core.step()
    core.add_request("late", prompts[2][:21], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for slot in core.runner.slots:  # the null block as at start, so the pad chunk's writes show
        slot[0].zero_()
    before = [slot.clone() for slot in core.runner.slots]
    spy = MixedSpy(mixed)
    core.step()  # schedules the late prompt beside both decodes
    assert spy.runs == 1 and spy.mixed == 1 and spy.padded == 1  # 23 tokens in the bucket of 32
    owned: list[set[int]] = [set() for _ in core.runner.slots]
    for request in core.scheduler.running:
        for g, table in enumerate(core.coordinator.block_ids(request.request_id)):
            pool = core.layout.groups[g].pool
            for s, slot_pool in enumerate(core.layout.slot_pool):
                if slot_pool == pool:
                    owned[s].update(table)
    null_written = []
    for s, (old, new) in enumerate(zip(before, core.runner.slots, strict=True)):
        changed = set(torch.nonzero((old != new).any(dim=1)).flatten().tolist())
        assert changed, f"slot {s}: the step wrote nothing"
        assert changed <= owned[s] | {0}, f"slot {s}: blocks {sorted(changed - owned[s] - {0})} written"
        null_written.append(0 in changed)
    # the pad chunk went through the cache (a layer fed token 0's zero embedding may write zeros)
    assert any(null_written)


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_uncaptured_steps_are_not_padded(preset: str) -> None:
    """Where no graph replays a bucket (the CPU), a step runs over its own chunks alone: no pad
    chunk in its batch, its rows the tokens it has, and the eager engine's greedy tokens."""
    eager, static = engine(preset, False, "cpu"), engine(preset, True, "cpu")
    mixed = static.runner.mixed
    assert mixed is not None and not mixed.captured and not mixed.pad_uncaptured
    spy = MixedSpy(mixed)
    sizes: list[tuple[int, int]] = []
    inner = mixed.run

    def sized(chunks: Sequence[StepChunk], *rest):  # rest: a launched step's previous ids
        hidden, batch = inner(chunks, *rest)
        sizes.append((sum(c.num_tokens for c in chunks), int(batch.input_ids.numel())))
        return hidden, batch

    mixed.run = sized  # type: ignore[method-assign]
    requests = short_mix(eager.info.arch.vocab_size)
    assert run(static, requests) == run(eager, requests)
    assert spy.runs > 0 and spy.padded == 0 and static.runner.eager_steps == 0
    assert sizes and all(count == rows for count, rows in sizes)
    assert any(mixed.bucket(count) > count for count, _ in sizes)  # steps a capture would have padded


def test_steps_larger_than_every_bucket_run_eagerly() -> None:
    """A step beyond the largest bucket (here a runner whose buckets stop short of the scheduler's
    budget) takes the eager forward and is counted; tokens stay the eager engine's."""
    eager, static = engine("tiny", False, "cpu"), engine("tiny", True, "cpu")
    runner = static.runner
    assert runner.mixed is not None
    runner.mixed = MixedStep(
        32, len(static.layout.groups), static.layout.block_size, runner.device, runner.model, [], runner.index_batch
    )
    requests = short_mix(eager.info.arch.vocab_size, 4)
    assert run(static, requests) == run(eager, requests)
    assert 0 < runner.eager_steps < eager.runner.eager_steps


def test_capture_needs_cuda() -> None:
    core = engine("tiny", True, "cpu")
    assert core.runner.mixed is not None and not core.runner.mixed.captured
    with pytest.raises(RuntimeError, match="CUDA"):
        core.runner.mixed.capture()
