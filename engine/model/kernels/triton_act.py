"""A gated MLP's activation and its gate product in one Triton kernel (CUDA; the CPU runs it under
``TRITON_INTERPRET=1``, for tests and for the benchmarks' kernel count).

``GatedMLP`` computes ``act(gate) * up`` from the fused gate/up projection ``[T, 2 * I]``: in torch
two launches (the activation, the product) and a temporary. Here one program per block of a row
reads both halves, applies the activation in fp32, rounds it to the model dtype (where torch's
activation rounds), multiplies by ``up`` and rounds again: equal to the torch path up to the
activation's own rounding (fp32 ``exp``/``tanh`` formulas differ from ATen's by an ulp or so).

Whether the runner uses it follows ``KVFLEET_ACT`` (``triton_attention.kernel_choice``): unset
means CUDA with triton available (as ``triton_rope``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.model.kernels.triton_attention import available, jit_in_place, kernel_choice, next_pow2

ENV = "KVFLEET_ACT"
tl: Any = None  # triton.language, bound by _kernels()

#: ``hidden_act`` names the kernel computes (``layers.blocks.activation``'s), by kernel code
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


def enabled(device: torch.device) -> bool:
    """Whether gated MLPs on ``device`` run this kernel (``kernel_choice`` of ``KVFLEET_ACT``):
    unset means CUDA with triton available."""
    return kernel_choice(ENV, device, device.type == "cuda" and available())


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up`` = ``[..., 2 * I]`` (gate columns then up columns, last
    dimension contiguous); returns ``[..., I]`` in ``gate_up``'s dtype."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0:
        return out.view(*gate_up.shape[:-1], width)
    block = min(1024, next_pow2(width))
    kernel = _kernels()
    kernel[(rows.shape[0], -(-width // block))](
        rows, out, rows.stride(0), out.stride(0), width, ACT=ACTIVATIONS[act], BLOCK=block, num_warps=4
    )
    return out.view(*gate_up.shape[:-1], width)


@functools.cache
def _kernels() -> Any:
    """Import triton and jit the kernel source below in place (in this module's namespace)."""
    namespace = globals()
    jit_in_place(namespace, ("_act_mul_kernel",), "activation and gate")
    return namespace["_act_mul_kernel"]


# ---- kernel source (jitted by _kernels) ------------------------------------------------------


def _act_mul_kernel(gate_up, out, stride_in, stride_out, width, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row r, block b): columns ``[b * BLOCK, (b + 1) * BLOCK)`` of row r's output."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    dtype = out.dtype.element_ty
    g = tl.load(gate_up + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * stride_in + width + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:  # silu
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # gelu, tanh approximation: 0.5 x (1 + tanh(y)) = x sigmoid(2 y), no cancellation
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * inner))
    else:  # gelu, erf
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    y = (a.to(dtype).to(tl.float32) * u).to(dtype)
    tl.store(out + row * stride_out + cols, y, mask=ok)
