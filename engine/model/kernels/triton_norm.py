"""RMS normalisation in one Triton kernel, with an optional residual add fused in (CUDA; the CPU
runs it under ``TRITON_INTERPRET=1``, for tests).

``layers.RMSNorm`` written in torch is three launches on a 16-bit model (the cast to fp32, the
norm, the cast back) and a residual add after it a fourth; with a dozen norms a decoder layer
(Gemma-3 has six, q/k norms included) those were the largest share of a decode step's kernels.
This kernel reads each row once, normalises in fp32 and writes the result in the input's dtype,
rounding exactly where the torch path rounds, so the two agree bit for bit in fp32 and to one
rounding in bf16:

* Gemma (``scale`` = ``1 + weight`` in fp32): ``(x * rstd * scale)`` rounded to the dtype;
* Llama (``weight`` in the model dtype): ``x * rstd`` rounded to the dtype, times the weight,
  rounded again (Hugging Face's order);
* with ``residual``: ``residual + that``, rounded (the decoder's ``x + norm(h)``).

Whether the runner uses it follows ``KVFLEET_NORM`` (``triton_attention.kernel_choice``): unset
means CUDA with triton available.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.model.kernels.triton_attention import _import_triton, jit_in_place, kernel_choice, next_pow2

ENV = "KVFLEET_NORM"
tl: Any = None  # triton.language, bound by _kernels()


def enabled(device: torch.device) -> bool:
    """Whether RMS norms on ``device`` run this kernel (``kernel_choice`` of ``KVFLEET_NORM``):
    unset means CUDA with triton available."""
    return kernel_choice(ENV, device, device.type == "cuda" and _import_triton() is not None)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` (any leading shape, last dimension contiguous).
    ``weight``: the fp32 ``1 + weight`` scale when ``gemma``, else the model-dtype weight.
    ``residual`` (``x``'s shape and dtype): returned plus the normalised rows."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    count = rows.shape[0]
    if count == 0:
        return out.view(x.shape)
    res = residual.reshape(-1, dim) if residual is not None else rows
    kernel = _kernels()
    block = max(16, next_pow2(dim))
    kernel[(count,)](
        rows,
        res,
        weight,
        out,
        rows.stride(0),
        res.stride(0),
        out.stride(0),
        dim,
        eps,
        GEMMA=gemma,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
    return out.view(x.shape)


@functools.cache
def _kernels() -> Any:
    """Import triton and jit the kernel source below in place (in this module's namespace)."""
    namespace = globals()
    jit_in_place(namespace, ("_rms_norm_kernel",), "rms norm")
    return namespace["_rms_norm_kernel"]


# ---- kernel source (jitted by _kernels) ------------------------------------------------------


def _rms_norm_kernel(
    x,
    residual,
    weight,
    out,
    stride_x,
    stride_r,
    stride_o,
    dim,
    eps,
    GEMMA: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program r: row r of ``x``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    values = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(values * values, axis=0) / dim + eps)
    normed = values * rstd
    w = tl.load(weight + cols, mask=ok, other=0.0)
    if GEMMA:
        y = (normed * w.to(tl.float32)).to(out.dtype.element_ty)
    else:
        y = (normed.to(out.dtype.element_ty).to(tl.float32) * w.to(tl.float32)).to(out.dtype.element_ty)
    if HAS_RESIDUAL:
        skip = tl.load(residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        y = (skip + y.to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + row * stride_o + cols, y, mask=ok)
