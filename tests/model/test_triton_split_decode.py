"""Split decode attention (engine/model/kernels/triton_split_decode.py) equals the one-program-per-
token kernel (``triton_attention.paged_attention_triton``) and, in engines, Hugging Face's logits.

Each case builds one layer's decode-only step over a random cache and shuffled block tables
(``build_paged_meta``) and runs both kernels on it; the split one must give the same output up to
fp32 summation order, leave its counters at zero, and actually split (``splits_for`` > 1, the
minimum keys per split lowered so short contexts split too). On a CUDA machine the kernels run
compiled (``benchmarks/gpu_suite.sh``'s triton stage); elsewhere under Triton's interpreter,
which runs a launch's programs one after another, so the counter's cross-program ordering is
checked only on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="the split decode kernel needs triton")

from engine.model.batch import ChunkSpec
from engine.model.kernels import triton_attention as ta
from engine.model.kernels import triton_split_decode as sd
from tests.model import logits_harness as harness
from tests.model.triton_interpreter import kernel_test_device

DEVICE = torch.device(kernel_test_device())


def decode_step(positions, kv_heads, groups, head_dim, block_size, window, seed, dtype=torch.float32):
    """q, the flat cache, its rows per block and the decode tokens' PagedMeta."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sizes = [p // block_size + 1 for p in positions]
    num_blocks = sum(sizes) + 2
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(size)] for size in sizes]
    chunks = [ChunkSpec(i, pos, 1) for i, pos in enumerate(positions)]
    meta = ta.build_paged_meta(chunks, tables, block_size, window, DEVICE)
    rows_per_block = 2 * block_size
    flat = torch.randn(num_blocks * rows_per_block, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(positions), kv_heads * groups, head_dim, generator=gen).to(DEVICE, dtype)
    return q, flat, rows_per_block, meta


FIELDS = ("positions", "kv_heads", "groups", "head_dim", "block_size", "window")
CASES = {
    name: dict(zip(FIELDS, values, strict=True))
    for name, values in {
        "mha-d32": ([5, 40, 0, 70, 33], 2, 1, 32, 4, None),
        "gqa4-window": ([63, 9, 100], 1, 4, 64, 16, 20),
        "gqa2-window-in-block": ([17, 3, 44], 2, 2, 32, 4, 3),
        "gqa4-d256": ([30, 2], 1, 4, 256, 16, None),
    }.items()
}


@pytest.mark.parametrize("softcap,sinks", [(None, False), (5.0, True)], ids=["plain", "softcap-sinks"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_split_kernel_equals_the_plain_kernel(name: str, softcap, sinks: bool, monkeypatch) -> None:
    monkeypatch.setattr(sd, "MIN_SPLIT_KEYS", 2)  # short contexts split too
    case = CASES[name]
    q, flat, rows_per_block, meta = decode_step(**case, seed=len(name))
    heads = q.shape[1]
    sink = torch.randn(heads, generator=torch.Generator().manual_seed(1)).to(DEVICE) if sinks else None
    block_size, window = case["block_size"], case["window"]
    splits = sd.splits_for(meta.num_tiles, flat.shape[1], meta.tables.shape[1] * block_size)
    assert splits > 1
    counters = torch.zeros(sd.COUNTERS, dtype=torch.int32, device=DEVICE)
    args = (q, flat, rows_per_block, block_size, meta, q.shape[2] ** -0.5, softcap, sink)
    want = ta.paged_attention_triton(*args, window)
    got = sd.split_decode(*args, counters)
    assert got is not None and got.shape == want.shape
    assert (got - want).abs().max().item() < 2e-5
    assert not bool(counters.any())  # the last share of each pair set its counter back
    again = sd.split_decode(*args, counters)  # a second launch (a replay) on the same counters
    assert again is not None and torch.equal(again, got)


def test_bfloat16_close_to_the_plain_kernel(monkeypatch) -> None:
    monkeypatch.setattr(sd, "MIN_SPLIT_KEYS", 2)
    case = CASES["gqa4-window"]
    q, flat, rows_per_block, meta = decode_step(**case, seed=7, dtype=torch.bfloat16)
    args = (q, flat, rows_per_block, case["block_size"], meta, 0.125, None, None)
    counters = torch.zeros(sd.COUNTERS, dtype=torch.int32, device=DEVICE)
    got = sd.split_decode(*args, counters)
    assert got is not None
    torch.testing.assert_close(
        got.float(), ta.paged_attention_triton(*args, case["window"]).float(), atol=2e-2, rtol=2e-2
    )


def test_only_decode_launches_that_split_take_it(monkeypatch) -> None:
    """A prompt tile, one split, or more pairs than counters: None (the plain kernel runs)."""
    q, flat, rows_per_block, meta = decode_step([5, 40], 1, 2, 32, 4, None, seed=3)
    counters = torch.zeros(sd.COUNTERS, dtype=torch.int32, device=DEVICE)
    args = (q, flat, rows_per_block, 4, meta, 0.2, None, None)
    assert sd.split_decode(*args, counters) is None  # 44 keys at most: one split of 256
    monkeypatch.setattr(sd, "MIN_SPLIT_KEYS", 2)
    assert sd.split_decode(*args, counters) is not None
    assert sd.split_decode(*args, counters[:1]) is None  # two pairs, one counter
    prompt = ta.build_paged_meta([ChunkSpec(0, 0, 3)], [[1]], 4, None, DEVICE)
    assert (
        sd.split_decode(
            q[:1].expand(3, -1, -1).contiguous(), flat, rows_per_block, 4, prompt, 0.2, None, None, counters
        )
        is None
    )


def test_a_lost_share_would_be_caught(monkeypatch) -> None:
    """The comparison sees a combine that misses a share: counters that start at 1 make a pair's
    first share to arrive the one that combines, before the other is written. Two splits, each
    holding keys (an empty share's state is the same in any launch, so scratch memory left by an
    earlier launch could stand in for it unseen), and no split launch of these inputs before it
    (its scratch, freed and handed out again, would hold the missing share's true state)."""
    monkeypatch.setattr(sd, "MIN_SPLIT_KEYS", 2)
    monkeypatch.setattr(sd, "MAX_SPLITS", 2)
    q, flat, rows_per_block, meta = decode_step([150, 200], 1, 2, 32, 16, None, seed=5)
    assert sd.splits_for(meta.num_tiles, 1, meta.tables.shape[1] * 16) == 2  # shares of 128 keys: both hold keys
    args = (q, flat, rows_per_block, 16, meta, 0.2, None, None)
    want = ta.paged_attention_triton(*args, None)
    counters = torch.ones(sd.COUNTERS, dtype=torch.int32, device=DEVICE)
    got = sd.split_decode(*args, counters)
    assert got is not None
    assert not torch.allclose(got, want, atol=1e-3, equal_nan=False)


def test_enabled_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sd.ENV, raising=False)
    assert not sd.enabled(torch.device("cuda")) and sd.make_counters(torch.device("cpu")) is None
    monkeypatch.setenv(sd.ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    counters = sd.make_counters(torch.device("cpu"))
    assert counters is not None and counters.numel() == sd.COUNTERS and not bool(counters.any())


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gpt-oss"])
def test_engine_on_the_split_kernel_matches_hugging_face(name: str, tmp_path, monkeypatch) -> None:
    """Decode steps split (short contexts too) in Gemma-3 (sliding window, GQA) and gpt-oss
    (sinks) engines: Hugging Face's logits."""
    from engine.model.checkpoints.qwen3_gpt_oss_tiny import build_random_checkpoint
    from engine.model.checkpoints.tiny import build_tiny_checkpoint

    monkeypatch.setattr(sd, "MIN_SPLIT_KEYS", 2)
    calls: list[bool] = []
    inner = sd.split_decode

    def spied(*args, **kwargs):
        out = inner(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(sd, "split_decode", spied)
    build = build_tiny_checkpoint if name == "tiny-gemma3" else build_random_checkpoint
    directory = build(name, tmp_path / name, seed=3)
    monkeypatch.setenv("KVFLEET_ATTENTION", "triton")
    monkeypatch.setenv(sd.ENV, "triton")
    harness.run_and_check(directory, str(DEVICE), harness.random_prompts(2, (11, 23)), 4)
    assert any(calls)
