"""The Triton paged attention path (engine/model/kernels/triton_attention.py) equals the torch path.

Each case runs ``layers.attention.paged_attention`` twice over the same random cache, block tables (shuffled
block ids, block 0 left as the null block) and mixed step (prefill chunks from nonzero positions
plus decode tokens): once through the torch path (``_gather`` + ``_attend``) and once through
``store_kv`` + ``paged_attention_triton``; the outputs and the written caches must agree. On a
CUDA machine the kernels run compiled; elsewhere under Triton's interpreter (``TRITON_INTERPRET``
is set by tests/conftest.py before any module is collected). The end-to-end cases drive tiny Gemma-3
(sliding window, softcap) and gpt-oss (sinks) engines with ``KVFLEET_ATTENTION=triton`` against
Hugging Face's logits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton", reason="the Triton attention path needs triton")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.model.batch import ChunkSpec, ForwardBatch, build_group_index
from engine.model.kernels import triton_attention as ta
from engine.model.layers.attention import paged_attention
from tests.model import logits_harness as harness
from tests.model.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device()


@dataclass
class Case:
    """One layer's step: chunks as (start, num_tokens); G query heads per KV head."""

    specs: tuple[tuple[int, int], ...]
    groups: int = 2
    head_dim: int = 32
    kv_heads: int = 2
    block_size: int = 4
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    seed: int = 0


def run_both(case: Case, dtype: torch.dtype = torch.float32, reference_dtype: torch.dtype | None = None):
    """(torch-path output, triton output, torch-path cache, triton cache). The torch path runs in
    ``reference_dtype`` (default ``dtype``) on the same (rounded) inputs."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    bs, rows_per_block = case.block_size, 2 * case.block_size + 1  # a padded page: rows != 2 * bs
    sizes = [-(-(start + n) // bs) for start, n in case.specs]
    num_blocks = sum(sizes) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    chunks, tables, offset = [], [], 0
    for (start, n), size in zip(case.specs, sizes, strict=True):
        table = [free.pop() for _ in range(size)]
        if case.window:  # blocks wholly below the first key any query reaches are null (block 0)
            lo = max(0, start - case.window + 1)
            table = [0 if (b + 1) * bs <= lo else block for b, block in enumerate(table)]
        tables.append(table)
        chunks.append(ChunkSpec(offset, start, n))
        offset += n
    heads = case.kv_heads * case.groups
    flat = torch.randn(num_blocks * rows_per_block, case.kv_heads, case.head_dim, generator=gen).to(dtype)
    q = torch.randn(offset, heads, case.head_dim, generator=gen).to(dtype)
    k = torch.randn(offset, case.kv_heads, case.head_dim, generator=gen).to(dtype)
    v = torch.randn(offset, case.kv_heads, case.head_dim, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen) if case.sinks else None
    decode = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
    prefill = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
    results = []
    for paged, run_dtype in ((False, reference_dtype or dtype), (True, dtype)):
        device = torch.device(DEVICE)
        index = build_group_index(chunks, tables, bs, case.window, prefill, decode, device, paged=paged)
        assert (index.paged is not None) == paged and (not paged or not index.prefill_reads)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        batch = ForwardBatch(empty, empty, chunks, prefill, decode, [index], empty)
        cache = flat.to(device, run_dtype)
        tensors = [t.to(device, run_dtype) for t in (q, k, v)]
        out = paged_attention(
            *tensors,
            cache,
            rows_per_block,
            bs,
            index,
            batch,
            case.head_dim**-0.5,
            case.softcap,
            None if sinks is None else sinks.to(device),
        )
        results.append((out.float().cpu(), cache.float().cpu()))
    (ref, ref_cache), (out, out_cache) = results
    return ref, out, ref_cache, out_cache


MIXED = ((5, 9), (0, 20), (17, 1), (3, 1), (40, 1), (0, 1))
CASES = {
    "mha-d64": Case(MIXED, groups=1, head_dim=64),
    "gqa2-window-in-block": Case(MIXED, window=3, softcap=5.0, sinks=True),
    "gqa4-window-crossing-blocks": Case(MIXED, groups=4, window=10, block_size=4, seed=1),
    "d256-sinks-window": Case(((9, 12), (30, 1), (2, 1)), groups=1, head_dim=256, window=7, sinks=True, kv_heads=1),
    "d32-block16-softcap": Case(((20, 30), (60, 1), (0, 7)), groups=2, block_size=16, softcap=2.0),
    "d48-long-chunk-tiles": Case(((0, 150), (3, 40), (100, 1)), head_dim=48, window=33, seed=2),
    "gqa8-d128": Case(((4, 24), (70, 1)), groups=8, kv_heads=1, head_dim=128, block_size=8, softcap=10.0, sinks=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_path_matches_torch_path_fp32(name: str) -> None:
    ref, out, ref_cache, out_cache = run_both(CASES[name])
    assert torch.equal(ref_cache, out_cache)
    assert (out - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["gqa2-window-in-block", "d256-sinks-window"])
def test_half_precision_close_to_fp32_on_the_same_inputs(name: str, dtype: torch.dtype) -> None:
    ref, out, ref_cache, out_cache = run_both(CASES[name], dtype, reference_dtype=torch.float32)
    assert torch.equal(ref_cache, out_cache)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    block_size = draw(st.sampled_from([1, 3, 4, 16]))
    specs = tuple(
        (draw(st.integers(0, 40)), draw(st.sampled_from([1, 1, 2, 5, 17]))) for _ in range(draw(st.integers(1, 4)))
    )
    return Case(
        specs,
        groups=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([16, 24, 32])),
        kv_heads=draw(st.integers(1, 2)),
        block_size=block_size,
        window=draw(st.sampled_from([None, 1, 2, 5, 19])),
        softcap=draw(st.sampled_from([None, 3.0])),
        sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 1000)),
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_steps_match_torch_path(case: Case) -> None:
    ref, out, ref_cache, out_cache = run_both(case)
    assert torch.equal(ref_cache, out_cache)
    assert (out - ref).abs().max().item() < 1e-4


def test_meta_tiles_and_window_trimmed_tables() -> None:
    chunks = [ChunkSpec(0, 30, 200), ChunkSpec(200, 50, 1)]
    tables = [list(range(100, 100 + 15)), list(range(200, 204))]
    meta = ta.build_paged_meta(chunks, tables, 16, 20, torch.device("cpu"))
    tiles = meta.tiles.tolist()
    assert meta.num_tiles == 3 and meta.max_tile_rows == ta.TILE_TOKENS
    assert sorted(t[3] for t in tiles) == [1, 72, 128]
    assert tiles[-1] == [1, 200, 50, 1, 1]  # the decode token: least work, last
    assert [t[1:4] for t in tiles[:2]] == [[0, 30, 128], [128, 158, 72]]  # 128 x 147 keys, then 72 x 91
    # Chunk 0's keys start at 30 - 19 = 11 (block 0); the decode token's at 31 (block 1).
    assert meta.tables.tolist()[1][:3] == [201, 202, 203]
    assert meta.tables.shape == (2, 15)
    with pytest.raises(ValueError, match="does not reach block"):
        ta.build_paged_meta([ChunkSpec(0, 0, 40)], [[1, 2]], 16, None, torch.device("cpu"))


def test_enabled_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("KVFLEET_ATTENTION", raising=False)
    assert not ta.enabled(cpu) and ta.enabled(cuda)
    monkeypatch.setenv("KVFLEET_ATTENTION", "torch")
    assert not ta.enabled(cuda)
    monkeypatch.setenv("KVFLEET_ATTENTION", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ta.enabled(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ta.enabled(cpu)
    monkeypatch.setenv("KVFLEET_ATTENTION", "flash")
    with pytest.raises(ValueError, match="KVFLEET_ATTENTION"):
        ta.enabled(cpu)


PROMPTS = harness.random_prompts(2, (5, 19, 40))
STEP = ("scheduler.prefill_chunk_size=16", "scheduler.max_num_batched_tokens=24")  # mixed steps


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gpt-oss"])
def test_engine_on_triton_path_matches_hf(name: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefill crossing the 16-token sliding windows, then decode: Gemma-3's GQA and
    head_dim 16, gpt-oss's random sinks."""
    from engine.model.checkpoints.qwen3_gpt_oss_tiny import build_random_checkpoint
    from engine.model.checkpoints.tiny import build_tiny_checkpoint

    build = build_tiny_checkpoint if name == "tiny-gemma3" else build_random_checkpoint
    directory = build(name, tmp_path / name, seed=3)
    monkeypatch.setenv("KVFLEET_ATTENTION", "triton")
    engine = harness.make_engine(directory, *STEP, device=DEVICE)
    assert engine.runner.paged_attention
    requests, logits = harness.drive(engine, PROMPTS, max_tokens=4)
    harness.check_against_hf(directory, requests, logits)


def test_engine_with_softcap_matches_torch_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Gemma-3 with a logit softcap that bites (2.0). HF's Gemma-3 ignores the field (it never
    hands it to its attention), so the oracle is the engine on the torch path."""
    from engine.model.checkpoints.tiny import build_tiny_checkpoint

    directory = build_tiny_checkpoint("tiny-gemma3", tmp_path / "g3", seed=3, attn_logit_softcapping=2.0)
    runs = []
    for choice in ("torch", "triton"):
        monkeypatch.setenv("KVFLEET_ATTENTION", choice)
        engine = harness.make_engine(directory, *STEP, device=DEVICE)
        assert engine.runner.paged_attention == (choice == "triton")
        runs.append(harness.drive(engine, PROMPTS, max_tokens=4)[1])
    for rid, rows in runs[0].items():
        for k, (ref, row) in enumerate(zip(rows, runs[1][rid], strict=True)):
            assert (row - ref).abs().max().item() < harness.ATOL, f"{rid} output {k}"
