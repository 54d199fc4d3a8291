"""The Triton RMS norm (engine/model/kernels/triton_norm.py) equals ``RMSNorm``'s torch path, and a tiny
Gemma-3 engine on it still gives Hugging Face's logits.

Both styles (Gemma's fp32 ``1 + weight`` scale, Llama's weight applied after the cast), with and
without the fused residual add, fp32 (within 1e-5) and bfloat16 (within two units in the last
place of the output: the kernel's ``rsqrt`` may differ from torch's in the last fp32 bits, which
flips a rounding now and then), widths that are
not powers of two, a 3-d input (the q/k norms' ``[tokens, heads, head_dim]``). On a CUDA machine
the kernel runs compiled; elsewhere under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton RMS norm needs triton")

from engine.model.layers.blocks import RMSNorm
from tests.model import logits_harness as harness
from tests.model.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device()


def bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at each value's magnitude (8 significant bits)."""
    magnitude = values.float().abs().clamp(min=2.0**-126)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - 7)


def norm_pair(dim: int, gemma: bool, dtype: torch.dtype, seed: int) -> tuple[RMSNorm, RMSNorm]:
    """The same norm twice: one on the torch path, one on the kernel."""
    torch.manual_seed(seed)
    torch_path = RMSNorm(dim, 1e-6, gemma).to(DEVICE, dtype)
    with torch.no_grad():
        torch_path.weight.normal_(0.0, 0.5)
    kernel = RMSNorm(dim, 1e-6, gemma).to(DEVICE, dtype)
    kernel.load_state_dict(torch_path.state_dict())
    torch_path._kernel, kernel._kernel = False, True
    return torch_path, kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(5, 640), (3, 4, 48), (1, 64)])
def test_kernel_equals_the_torch_path(dtype: torch.dtype, gemma: bool, residual: bool, shape: tuple) -> None:
    torch_path, kernel = norm_pair(shape[-1], gemma, dtype, seed=len(shape) * 7 + shape[-1])
    x = (torch.randn(shape, device=DEVICE) * 3.0).to(dtype)
    skip = torch.randn(shape, device=DEVICE).to(dtype) if residual else None
    with torch.no_grad():
        want, got = torch_path(x, skip), kernel(x, skip)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want, dtype, skip)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, skip: torch.Tensor | None = None) -> None:
    """fp32 within 1e-5; bf16 within two units in the last place of the output (the rsqrt's last
    bits: an H200 showed one), and where a residual ``skip`` enters, two units of the row's
    largest term as well: ``skip + y`` cancels, so a one-unit difference in the normed ``y``
    (seen on an H200) is many units of a small sum, and a norm of that sum carries it on."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        assert (got - want).abs().max().item() < 1e-5
        return
    tolerance = 2 * bf16_ulp(want)
    if skip is not None:
        terms = torch.maximum(want.float().abs(), skip.float().abs()).amax(dim=-1, keepdim=True)
        tolerance = tolerance + 2 * bf16_ulp(terms)
    assert bool(((got.float() - want.float()).abs() <= tolerance).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("shape", [(5, 640), (1, 64)])
def test_fused_residual_and_next_norm_equal_the_torch_path(dtype: torch.dtype, gemma: bool, shape: tuple) -> None:
    """``then`` (norm, residual, next norm) and ``add`` (residual, norm): one launch each on the
    kernel, the same values as the torch path's calls."""
    first_torch, first = norm_pair(shape[-1], gemma, dtype, seed=3)
    second_torch, second = norm_pair(shape[-1], gemma, dtype, seed=4)
    x = (torch.randn(shape, device=DEVICE) * 3.0).to(dtype)
    skip = torch.randn(shape, device=DEVICE).to(dtype)
    with torch.no_grad():
        for got, want in zip(first.then(x, skip, second), first_torch.then(x, skip, second_torch), strict=True):
            assert_close(got, want, dtype, skip)
        for got, want in zip(first.add(x, skip), first_torch.add(x, skip), strict=True):
            assert_close(got, want, dtype, skip)
        total, normed = first_torch.add(x, skip)
        assert torch.equal(total, skip + x) and torch.equal(normed, first_torch(skip + x))


@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("post_norm", [False, True])
def test_entering_a_pending_residual_equals_the_unfused_add_and_norm(gemma: bool, post_norm: bool) -> None:
    """``enter`` sums the previous layer's ``PendingResidual`` (its delta normed first when it has
    a post-norm) and normalises the sum: on the kernel one launch, the torch path's values."""
    from engine.model.layers.blocks import PendingResidual

    norm_torch, norm = norm_pair(640, gemma, torch.float32, seed=5)
    post_torch, post = norm_pair(640, gemma, torch.float32, seed=6)
    x, delta = torch.randn(5, 640, device=DEVICE), torch.randn(5, 640, device=DEVICE)
    with torch.no_grad():
        state = x + (post_torch(delta) if post_norm else delta)
        want = (state, norm_torch(state))
        for path, after in ((norm_torch, post_torch), (norm, post)):
            got = path.enter(x, PendingResidual(delta, after if post_norm else None))
            for value, expected in zip(got, want, strict=True):
                assert (value - expected).abs().max().item() < 1e-5
        assert torch.equal(norm.enter(x, None)[1], norm(x))


def test_a_wrong_scale_would_be_caught() -> None:
    """The comparison sees a kernel fed Gemma's raw weight instead of ``1 + weight`` (it can fail)."""
    from engine.model.kernels import triton_norm

    torch_path, kernel = norm_pair(640, True, torch.float32, seed=1)
    x = torch.randn(4, 640, device=DEVICE)
    with torch.no_grad():
        broken = triton_norm.rms_norm(x, kernel.weight.float(), 1e-6, gemma=True)
        assert (broken - torch_path(x)).abs().max().item() > 1e-2


def test_gemma3_engine_on_the_kernel_matches_hugging_face(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVFLEET_NORM", "triton")
    from engine.model.checkpoints.tiny import build_tiny_checkpoint

    directory = build_tiny_checkpoint("tiny-gemma3", tmp_path / "gemma3", seed=0)
    harness.run_and_check(directory, DEVICE, harness.random_prompts(2, (11, 23)), 4)


def test_prenorm_hybrid_engine_on_the_kernel_matches_hugging_face(tmp_path, monkeypatch) -> None:
    """Bamba's residual adds are summed by the next layer's input norm (and the last by the final
    norm) in the kernel's add-then-norm launch; the logits stay Hugging Face's."""
    monkeypatch.setenv("KVFLEET_NORM", "triton")
    from engine.model.checkpoints.tiny import build_tiny_checkpoint

    directory = build_tiny_checkpoint("tiny-bamba", tmp_path / "bamba", seed=0)
    harness.run_and_check(directory, DEVICE, harness.random_prompts(2, (11, 23)), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [48, 64])
def test_gated_norm_kernel_equals_the_torch_path(dtype: torch.dtype, group_size: int) -> None:
    """Mamba2's gated output norm (``GatedRMSNorm``): the kernel against the torch path, fp32
    product in, the model dtype out (as ``Mamba2Mixer`` calls it)."""
    from engine.model.layers.mamba2 import GatedRMSNorm

    torch.manual_seed(group_size)
    channels = 3 * group_size
    torch_path = GatedRMSNorm(channels, group_size, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        torch_path.weight.normal_(1.0, 0.5)
    kernel = GatedRMSNorm(channels, group_size, 1e-6).to(DEVICE, dtype)
    kernel.load_state_dict(torch_path.state_dict())
    torch_path._kernel, kernel._kernel = False, True
    x = torch.randn(5, channels, device=DEVICE) * 2.0
    gate = (torch.randn(5, channels, device=DEVICE) * 2.0).to(dtype)
    with torch.no_grad():
        want, got = torch_path(x, gate, dtype), kernel(x, gate, dtype)
    assert_close(got, want, dtype)
    with torch.no_grad():  # a kernel that skipped the gate would be caught
        ungated = kernel(x, torch.full_like(gate, 30.0), dtype)
    assert (ungated.float() - want.float()).abs().max().item() > 1e-2
