"""The fused q/k norm + rotary kernel (engine/model/kernels/triton_rope.py) equals the torch path
(``RMSNorm`` then ``Rotary.apply``), and tiny Gemma-3 and Qwen3 engines on it give Hugging Face's
logits.

Cases: Gemma's ``1 + weight`` norms, Llama/Qwen's weight-after-rounding norms, no q/k norm, a
partial rotary (``rotary_dim`` < head_dim), GQA head counts, fp32 (within 1e-5) and bfloat16
(within two roundings of the output: the torch path rounds after each product, the kernel once).
On a CUDA machine the kernel runs compiled; elsewhere under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton rope kernel needs triton")

from engine.model.arch.model_arch import RopeArch
from engine.model.kernels import triton_rope
from engine.model.layers.blocks import RMSNorm, Rotary
from tests.model import logits_harness as harness
from tests.model.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device()


def torch_path(q, k, cos, sin, rotary: Rotary, norms):
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["gemma", "llama", "none"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 0), (48, 16)])
def test_kernel_equals_norm_then_rotary(dtype: torch.dtype, norm: str, head_dim: int, rotary_dim: int) -> None:
    torch.manual_seed(head_dim + rotary_dim + len(norm))
    tokens, heads, kv_heads = 5, 4, 2
    rotary = Rotary(RopeArch(theta=10000.0, rotary_dim=rotary_dim), head_dim).to(DEVICE)
    positions = torch.tensor([0, 3, 17, 200, 4095], device=DEVICE)
    cos, sin = rotary.cos_sin(positions, dtype)
    norms = None
    if norm != "none":
        norms = tuple(RMSNorm(head_dim, 1e-6, gemma=norm == "gemma").to(DEVICE, dtype) for _ in range(2))
        for n in norms:
            with torch.no_grad():
                n.weight.normal_(0.0, 0.5)
            n._kernel = False
    q = (torch.randn(tokens, heads, head_dim, device=DEVICE) * 2).to(dtype)
    k = (torch.randn(tokens, kv_heads, head_dim, device=DEVICE) * 2).to(dtype)
    want_q, want_k = torch_path(q, k, cos, sin, rotary, norms)
    weights = None if norms is None else tuple(n.weight_for_kernel() for n in norms)
    got_q, got_k = triton_rope.norm_rope(q, k, cos, sin, rotary.rotary_dim, weights, 1e-6, norm == "gemma")
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.shape == want.shape and got.dtype == want.dtype
        if dtype == torch.float32:
            assert (got - want).abs().max().item() < 1e-5
        else:
            tolerance = want.float().abs() * 2**-6 + 0.02
            assert bool(((got.float() - want.float()).abs() <= tolerance).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_stores_the_new_keys_and_values_in_their_pages(dtype: torch.dtype) -> None:
    """With ``store`` the key heads' programs also write K (rotated) and V into the cache rows
    ``key`` and ``key + block_size`` (``key = block * rows_per_block + offset``), as
    ``triton_attention.store_kv`` does; no other row changes."""
    torch.manual_seed(11)
    tokens, heads, kv_heads, head_dim, block_size = 3, 4, 2, 32, 4
    rotary = Rotary(RopeArch(theta=10000.0), head_dim).to(DEVICE)
    cos, sin = rotary.cos_sin(torch.tensor([1, 6, 9], device=DEVICE), dtype)
    q = torch.randn(tokens, heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, device=DEVICE).to(dtype)
    flat = torch.randn(6 * 2 * block_size, kv_heads, head_dim, device=DEVICE).to(dtype)
    before = flat.clone()
    rows_per_block = 2 * block_size
    write_block, write_offset = torch.tensor([0, 1, 4], device=DEVICE), torch.tensor([1, 3, 0], device=DEVICE)
    key_rows = write_block * rows_per_block + write_offset
    store = (v, flat, write_block, write_offset, rows_per_block, block_size)
    got_q, got_k = triton_rope.norm_rope(q, k, cos, sin, head_dim, None, 1e-6, False, store)
    want_q, want_k = triton_rope.norm_rope(q, k, cos, sin, head_dim, None, 1e-6, False)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    want = before.clone()
    want[key_rows], want[key_rows + block_size] = want_k, v
    assert torch.equal(flat, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_the_positions_rows_of_a_table(dtype: torch.dtype) -> None:
    """With ``rows`` (the tokens' positions) ``cos``/``sin`` are tables of every position: the
    result equals the per-token cos/sin of those positions bit for bit, and a position past the
    table reads its last row."""
    torch.manual_seed(5)
    rotary = Rotary(RopeArch(theta=10000.0, rotary_dim=32), 48).to(DEVICE)
    positions = torch.tensor([0, 7, 3, 63, 20], device=DEVICE)
    cos_table, sin_table = rotary.cos_sin(torch.arange(64, device=DEVICE), dtype)
    cos, sin = rotary.cos_sin(positions, dtype)
    q = torch.randn(5, 4, 48, device=DEVICE).to(dtype)
    k = torch.randn(5, 2, 48, device=DEVICE).to(dtype)
    want = triton_rope.norm_rope(q, k, cos, sin, 32, None, 1e-6, False)
    got = triton_rope.norm_rope(q, k, cos_table, sin_table, 32, None, 1e-6, False, rows=positions)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    past = triton_rope.norm_rope(q, k, cos_table, sin_table, 32, None, 1e-6, False, rows=positions + 1000)
    last = torch.full_like(positions, 63)
    assert torch.equal(past[0], triton_rope.norm_rope(q, k, cos_table, sin_table, 32, None, 1e-6, False, rows=last)[0])
    shifted = triton_rope.norm_rope(q, k, cos_table, sin_table, 32, None, 1e-6, False, rows=positions.flip(0))
    assert not torch.equal(shifted[0], want[0])  # the rows read are the positions' own


def test_an_engine_on_the_fused_path_binds_one_table_per_rotary_type(tmp_path, monkeypatch) -> None:
    """Gemma-3's two rotary types (local and global theta) give two tables, shared by the layers
    of each type, holding ``Rotary.cos_sin`` of every position below the engine's max length;
    the torch path binds none."""
    from engine.model.checkpoints.tiny import build_tiny_checkpoint
    from engine.model.layers.attention import Attention

    directory = build_tiny_checkpoint("tiny-gemma3", tmp_path / "gemma3", seed=0)
    monkeypatch.setenv("KVFLEET_ROPE", "torch")
    plain = harness.make_engine(directory, device=DEVICE)
    assert all(m.rope_table is None for m in plain.runner.model.modules() if isinstance(m, Attention))
    monkeypatch.setenv("KVFLEET_ROPE", "triton")
    engine = harness.make_engine(directory, device=DEVICE)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, Attention)]
    tables = {id(m.rope_table): m for m in layers if m.rope_table is not None}
    assert len(tables) == 2 and all(m.rope_table is not None for m in layers)
    for layer in tables.values():
        assert layer.rotary is not None and layer.rope_table is not None
        cos, sin = layer.rope_table
        assert cos.shape[0] == engine.info.max_model_len
        want = layer.rotary.cos_sin(torch.tensor([0, 5, cos.shape[0] - 1], device=cos.device), cos.dtype)
        assert torch.equal(cos[[0, 5, -1]], want[0]) and torch.equal(sin[[0, 5, -1]], want[1])


def test_a_missing_rotation_would_be_caught() -> None:
    """The comparison sees a kernel given cos = 1, sin = 0 (no rotation): it can fail."""
    rotary = Rotary(RopeArch(theta=10000.0), 64).to(DEVICE)
    cos, sin = rotary.cos_sin(torch.tensor([5, 9], device=DEVICE), torch.float32)
    q, k = torch.randn(2, 2, 64, device=DEVICE), torch.randn(2, 1, 64, device=DEVICE)
    got_q, _ = triton_rope.norm_rope(q, k, torch.ones_like(cos), torch.zeros_like(sin), 64, None, 1e-6, False)
    want_q, _ = torch_path(q, k, cos, sin, rotary, None)
    assert (got_q - want_q).abs().max().item() > 1e-2


@pytest.mark.parametrize("paged", [False, True], ids=["torch-attention", "all-kernels"])
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3"])
def test_engine_on_the_fused_kernels_matches_hugging_face(name: str, paged: bool, tmp_path, monkeypatch) -> None:
    """``all-kernels``: the path ``benchmarks/support/op_count.fused_path`` counts (paged attention
    with the KV store in the rotary kernel, fused norms, the activation kernel)."""
    monkeypatch.setenv("KVFLEET_ROPE", "triton")
    monkeypatch.setenv("KVFLEET_NORM", "triton")
    if paged:
        monkeypatch.setenv("KVFLEET_ATTENTION", "triton")
        monkeypatch.setenv("KVFLEET_ACT", "triton")
    if name == "tiny-gemma3":
        from engine.model.checkpoints.tiny import build_tiny_checkpoint

        directory = build_tiny_checkpoint(name, tmp_path / name, seed=0)
    else:
        from engine.model.checkpoints.qwen3_gpt_oss_tiny import build_random_checkpoint

        directory = build_random_checkpoint(name, tmp_path / name, seed=3)
    harness.run_and_check(directory, DEVICE, harness.random_prompts(2, (11, 23)), 4)
