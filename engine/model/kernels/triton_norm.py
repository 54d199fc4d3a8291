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
    return _launch(x, weight, eps, gemma, residual, None, False)[0]


def norm_add_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, then: torch.Tensor, eps: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + norm(x; weight)`` and ``norm(s; then)`` in one launch (Gemma's post-norm
    with its residual, then the next pre-norm); each equals ``rms_norm``'s result bit for bit."""
    out, normed = _launch(x, weight, eps, gemma, residual, then, False)
    assert normed is not None
    return out, normed


def add_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` (rounded to the dtype) and ``norm(s; weight)`` in one launch (a
    pre-norm decoder's residual add and the next norm)."""
    out, normed = _launch(x, weight, eps, gemma, residual, weight, True)
    assert normed is not None
    return out, normed


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    residual: torch.Tensor | None,
    then: torch.Tensor | None,
    add_first: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch: ``out`` = the normed rows (``residual`` added after the norm, or before it with
    ``add_first``: then ``out`` is the sum and only ``normed`` is normalised); with ``then``,
    ``normed`` = ``out`` normalised again by ``then``."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    second = torch.empty_like(rows) if then is not None else None
    count = rows.shape[0]
    if count == 0:
        return out.view(x.shape), None if second is None else second.view(x.shape)
    res = residual.reshape(-1, dim) if residual is not None else rows
    if res.stride(-1) != 1:
        res = res.contiguous()
    kernel, _ = _kernels()
    block = max(16, next_pow2(dim))
    kernel[(count,)](
        rows,
        res,
        weight,
        then if then is not None else weight,
        out,
        second if second is not None else out,
        rows.stride(0),
        res.stride(0),
        out.stride(0),
        dim,
        eps,
        GEMMA=gemma,
        HAS_RESIDUAL=residual is not None,
        ADD_FIRST=add_first,
        SECOND=then is not None and not add_first,
        num_warps=4 if block <= 2048 else 8,
        BLOCK=block,
    )
    return out.view(x.shape), None if second is None else second.view(x.shape)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Mamba2's output norm in one launch: ``h = x * silu(gate)`` in fp32, each ``group_size``
    channels RMS-normalised, times ``weight``, rounded once to ``dtype`` (``mamba2.GatedRMSNorm``'s
    torch path rounds there too). ``x``, ``gate``: ``[T, C]``, last dimension contiguous."""
    tokens, channels = x.shape
    out = torch.empty((tokens, channels), dtype=dtype, device=x.device)
    if tokens == 0:
        return out
    if x.stride(1) != 1 or gate.stride(1) != 1:
        raise ValueError("gated_rms_norm: the channels of x and gate must be contiguous")
    _, gated = _kernels()
    block = max(16, next_pow2(group_size))
    gated[(tokens, channels // group_size)](
        x, gate, weight, out, x.stride(0), gate.stride(0), out.stride(0), group_size, eps, BLOCK=block, num_warps=4
    )
    return out


@functools.cache
def _kernels() -> Any:
    """Import triton and jit the kernel source below in place (in this module's namespace)."""
    namespace = globals()
    jit_in_place(namespace, ("_normed", "_rms_norm_kernel", "_gated_rms_norm_kernel"), "rms norm")
    return namespace["_rms_norm_kernel"], namespace["_gated_rms_norm_kernel"]


# ---- kernel source (jitted by _kernels) ------------------------------------------------------


def _rms_norm_kernel(
    x,
    residual,
    weight,
    weight2,
    out,
    out2,
    stride_x,
    stride_r,
    stride_o,
    dim,
    eps,
    GEMMA: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ADD_FIRST: tl.constexpr,
    SECOND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program r: row r of ``x`` (``out2`` shares ``out``'s strides)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    dtype = out.dtype.element_ty
    values = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD_FIRST:  # out = residual + x; out2 = norm(out)
        skip = tl.load(residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        total = (skip + values).to(dtype)
        tl.store(out + row * stride_o + cols, total, mask=ok)
        y = _normed(total.to(tl.float32), weight, cols, ok, dim, eps, dtype, GEMMA)
        tl.store(out2 + row * stride_o + cols, y, mask=ok)
    else:
        y = _normed(values, weight, cols, ok, dim, eps, dtype, GEMMA)
        if HAS_RESIDUAL:
            skip = tl.load(residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            y = (skip + y.to(tl.float32)).to(dtype)
        tl.store(out + row * stride_o + cols, y, mask=ok)
        if SECOND:
            z = _normed(y.to(tl.float32), weight2, cols, ok, dim, eps, dtype, GEMMA)
            tl.store(out2 + row * stride_o + cols, z, mask=ok)


def _normed(values, weight, cols, ok, dim, eps, dtype: tl.constexpr, GEMMA: tl.constexpr):
    """One fp32 row normalised and scaled, rounded to ``dtype`` where ``layers.RMSNorm`` rounds."""
    rstd = tl.rsqrt(tl.sum(values * values, axis=0) / dim + eps)
    normed = values * rstd
    w = tl.load(weight + cols, mask=ok, other=0.0)
    if GEMMA:
        y = (normed * w.to(tl.float32)).to(dtype)
    else:
        y = (normed.to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)
    return y


def _gated_rms_norm_kernel(x, gate, weight, out, stride_x, stride_g, stride_o, group_size, eps, BLOCK: tl.constexpr):
    """Program (row r, group j): channels ``[j * group_size, (j + 1) * group_size)`` of row r."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    ok = tl.arange(0, BLOCK) < group_size
    values = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(gate + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    h = values * (g / (1.0 + tl.exp(-g)))
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / group_size + eps)
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (h * rstd * w).to(out.dtype.element_ty), mask=ok)
