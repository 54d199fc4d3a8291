"""The Triton activation-and-gate kernel (engine/model/kernels/triton_act.py) equals ``GatedMLP``'s
torch path, ``act(gate) * up``, for each activation: fp32 within 1e-5 relative, bfloat16 within
two units in the last place (the kernel's ``exp``/``erf`` may differ from ATen's in the last fp32
bits, which moves a rounding). On a CUDA machine the kernel runs compiled; elsewhere under
Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton activation kernel needs triton")

from engine.model.kernels import triton_act
from engine.model.layers.blocks import GatedMLP
from tests.model.test_triton_norm import bf16_ulp
from tests.model.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device()


def mlp_pair(act: str, dtype: torch.dtype) -> tuple[GatedMLP, GatedMLP]:
    """The same fused-projection MLP twice: one on the torch path, one on the kernel."""
    torch.manual_seed(len(act))
    torch_path = GatedMLP(48, 200, act).to(DEVICE, dtype)
    kernel = GatedMLP(48, 200, act).to(DEVICE, dtype)
    kernel.load_state_dict(torch_path.state_dict())
    for mlp, on in ((torch_path, False), (kernel, True)):
        mlp.fuse_projections()
        mlp._kernel = on
    return torch_path, kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", sorted(triton_act.ACTIVATIONS))
def test_kernel_equals_the_torch_path(act: str, dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    gate_up = (torch.randn(7, 2 * 1100, device=DEVICE) * 3.0).to(dtype)  # several blocks, a ragged last one
    gate, up = gate_up.chunk(2, dim=-1)
    want = GatedMLP(4, 4, act).act(gate) * up
    got = triton_act.act_mul(gate_up, act)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        assert bool(((got - want).abs() <= 1e-5 * (1.0 + want.abs())).all())
    else:
        # near the activation's underflow (gelu of a large negative) the fp32 formulas part by ~1e-7
        assert bool(((got.float() - want.float()).abs() <= 2 * bf16_ulp(want) + 1e-6).all())
    torch_path, kernel = mlp_pair(act, dtype)
    x = torch.randn(3, 48, device=DEVICE).to(dtype)
    with torch.no_grad():
        mlp_want, mlp_got = torch_path(x), kernel(x)
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert (mlp_got.float() - mlp_want.float()).abs().max().item() < tolerance


def test_a_wrong_activation_would_be_caught() -> None:
    """The comparison sees silu's kernel where gelu is asked (it can fail)."""
    gate_up = torch.randn(4, 64, device=DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    want = GatedMLP(4, 4, "gelu_pytorch_tanh").act(gate) * up
    assert (triton_act.act_mul(gate_up, "silu") - want).abs().max().item() > 1e-2
