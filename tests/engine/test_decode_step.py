"""The static, bucket-padded decode step (``engine.model.decode_step``) against the eager step.

Oracle: the same engine configuration with ``model.cuda_graphs=false``, which builds and runs every
step eagerly and unpadded (the path the logits tests check against Hugging Face). On the CPU the
static step runs uncaptured, on CUDA (``KVFLEET_TEST_DEVICE=cuda``) as captured graphs where the
model allows. Workloads have odd batch sizes (so rows are padded), cross block boundaries (so
slot tables grow), and run under memory pressure (so requests are preempted and re-admitted with
new block tables).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.core import EngineCore
from engine.model.decode_step import decode_buckets
from engine.sampling_params import SamplingParams
from tests.model.triton_interpreter import patch_interpreter
from tests.support import load_preset

PRESETS = ["tiny", "tiny-hybrid", "tiny-granite-h", "tiny-nemotron-h", "tiny-qwen3-next"]


def engine(preset: str, graphs: bool, *overrides: str) -> EngineCore:
    return EngineCore(load_preset(preset, [f"model.cuda_graphs={str(graphs).lower()}", *overrides]))


def workload(seed: int, count: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 60))] for _ in range(count)]
    return [(prompt, rng.randrange(4, 40)) for prompt in prompts]


def run(core: EngineCore, requests: list[tuple[list[int], int]]) -> dict[str, list[int]]:
    """Greedy tokens of every request, all added at once and stepped to the end."""
    for i, (prompt, max_tokens) in enumerate(requests):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not core.has_work:
            break
        for out in core.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not core.has_work
    return tokens


class PaddingSpy:
    """Counts the decode step's runs and the padded ones (bucket larger than the batch)."""

    def __init__(self, core: EngineCore):
        decode = core.runner.decode
        assert decode is not None
        self.runs = self.padded = 0
        inner = decode.run

        def counted(chunks, *rest):  # rest: a launched step's previous ids and rows
            self.runs += 1
            self.padded += decode.bucket(len(chunks)) > len(chunks)
            return inner(chunks, *rest)

        decode.run = counted  # type: ignore[method-assign]


def test_buckets_cover_every_batch_size() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(16) == (1, 2, 4, 8, 16)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert decode_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    for top in (1, 3, 16, 40, 64, 100):
        buckets = decode_buckets(top)
        assert all(any(b >= n for b in buckets) for n in range(1, top + 1)) and buckets[-1] == top


@pytest.mark.parametrize("preset", PRESETS)
def test_padded_decode_gives_the_eager_tokens(preset: str) -> None:
    eager = engine(preset, False)
    assert eager.runner.decode is None
    static = engine(preset, True)
    spy = PaddingSpy(static)
    requests = workload(7, 11, eager.info.arch.vocab_size)
    want = run(eager, requests)
    got = run(static, requests)
    assert got == want
    assert spy.runs > 20 and spy.padded > 0
    assert static.runner.decode.num_slots_held == 0  # every finished request gave its slot back


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_preempted_and_readmitted_requests_keep_their_tokens(preset: str) -> None:
    """A pool too small for the batch: requests are preempted, re-admitted with new block tables
    (their slot rows rewritten) and must still decode what the eager engine decodes."""
    small = ("kv_cache.num_blocks=96", "kv_cache.pinning.enabled=false")
    eager, static = engine(preset, False, *small), engine(preset, True, *small)
    requests = workload(11, 14, eager.info.arch.vocab_size)
    want = run(eager, requests)
    got = run(static, requests)
    assert static.scheduler.num_preemptions > 0
    assert got == want


def test_padded_rows_write_only_null_blocks() -> None:
    """One padded decode step changes KV pages only in the null block and the blocks of the
    requests it decodes (one step at a time: no step launched while another runs)."""
    core = engine("tiny-hybrid", True, "scheduler.async_scheduling=false")
    vocab = core.info.arch.vocab_size
    for i, (prompt, _) in enumerate(workload(3, 3, vocab)):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    running = core.scheduler.running
    while len(running) < 3 or any(r.num_tokens - r.num_computed_tokens != 1 for r in running):
        core.step()
    before = [slot.clone() for slot in core.runner.slots]
    owned = [set() for _ in core.runner.slots]
    for request in core.scheduler.running:
        for g, table in enumerate(core.coordinator.block_ids(request.request_id)):
            pool = core.layout.groups[g].pool
            for s, slot_pool in enumerate(core.layout.slot_pool):
                if slot_pool == pool:
                    owned[s].update(table)
    spy = PaddingSpy(core)
    core.step()
    assert spy.runs == 1 and spy.padded == 1  # 3 rows in the bucket of 4
    for s, (old, new) in enumerate(zip(before, core.runner.slots, strict=True)):
        changed = set(torch.nonzero((old != new).any(dim=1)).flatten().tolist())
        assert changed, f"slot {s}: the step wrote nothing"
        assert changed <= owned[s] | {0}, f"slot {s}: blocks {sorted(changed - owned[s] - {0})} written"


def test_triton_attention_reads_the_slot_tables(monkeypatch) -> None:
    """The paged (Triton) attention path of the static step, interpreted on the CPU (compiled, and
    captured as a graph, on CUDA): its int64 tiles and slot tables give the eager tokens."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        patch_interpreter()
    monkeypatch.setenv("KVFLEET_ATTENTION", "triton")
    eager, static = engine("tiny", False), engine("tiny", True)
    assert static.runner.paged_attention
    requests = workload(5, 3, eager.info.arch.vocab_size)
    requests = [(prompt[:20], 8) for prompt, _ in requests]
    assert run(static, requests) == run(eager, requests)
