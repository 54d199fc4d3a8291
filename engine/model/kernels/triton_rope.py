"""The q/k RMS norms and the rotary embedding of an attention layer in one Triton kernel (CUDA; the
CPU runs it under ``TRITON_INTERPRET=1``, for tests).

Written in torch, a layer's q and k each take a norm (``triton_norm``: one launch) and a rotary
(a flip, two products, a sum and, for partial rotary, a concatenation): about ten launches per
layer. Here one launch covers every query and key head of every token: program (token, head)
loads the head's row, optionally RMS-normalises it (Gemma's fp32 ``1 + weight`` scale, rounded
to the model dtype as ``RMSNorm`` rounds, or Llama/Qwen's weight after the rounding), then
rotates its first ``rotary_dim`` values by the rotate-half convention with ``Rotary.cos_sin``'s
cos and sign-folded sin, in fp32, and writes the row once in the model dtype (and, given the
cache, a key head's program writes the token's K and V rows into their page too, so the paged
attention path needs no separate store launch). Each row's partner
half is read from memory again (normalised with the same ``rstd``), so no value moves between
lanes. In fp32 this equals ``RMSNorm`` + ``Rotary.apply``; in bf16 it rounds once where the torch
path rounds after each product (closer to the fp32 result). In the engine the cos and sin come
from tables of every position up to the engine's max length, built once per rotary type
(``Attention.bind_rope_table``), and each program reads its token's row by position: a step
launches nothing to compute them (a per-step ``Rotary.cos_sin`` is about nine launches per type).

Whether the runner uses it follows ``KVFLEET_ROPE`` (``triton_attention.kernel_choice``): unset
means CUDA with triton available (see ``enabled``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.model.kernels.triton_attention import available, jit_in_place, kernel_choice, next_pow2

ENV = "KVFLEET_ROPE"
tl: Any = None  # triton.language, bound by _kernels()


def enabled(device: torch.device) -> bool:
    """Whether attention layers on ``device`` run this kernel (``kernel_choice`` of
    ``KVFLEET_ROPE``): unset means CUDA with triton available (checked compiled on an H200 against
    the torch path and, in the engines of the GPU suite's test stages, Hugging Face's logits;
    README, "GPU workers")."""
    return kernel_choice(ENV, device, device.type == "cuda" and available())


def norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    norms: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    gemma: bool,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New q ``[T, H, D]`` and k ``[T, KVH, D]``: each head row normalised (``norms``: the q and k
    weights, Gemma's as the fp32 ``1 + weight`` scale; None: no q/k norm), then rotated on its
    first ``rotary_dim`` values. ``cos``/``sin``: ``Rotary.cos_sin`` of the tokens' positions.
    ``store`` = (``v`` [T, KVH, D], ``flat`` cache rows, ``write_block`` [T], ``write_offset``
    [T], ``rows_per_block``, ``block_size``): the same launch also writes each token's new K row
    to ``flat[key]``, ``key = write_block[t] * rows_per_block + write_offset[t]``, and its V row
    to ``flat[key + block_size]`` (``layers.attention.paged_attention``'s layout). ``rows``
    (``[T]`` positions): ``cos``/``sin`` are tables of every position (``Attention.rope_table``)
    and token t reads row ``rows[t]`` (clamped to the table), so no per-step cos/sin is needed."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if tokens == 0:
        return q_out, k_out
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("norm_rope: the last dimension of q, k, cos and sin must be contiguous")
    q_weight, k_weight = norms if norms is not None else (cos, cos)  # unread without NORM
    v, flat, blocks, offsets, rows_per_block, block_size = store or (k, k_out, cos, cos, 0, 0)  # unread without STORE
    if store is not None and (v.stride(2) != 1 or flat.stride(2) != 1):
        raise ValueError("norm_rope: the last dimension of v and the cache must be contiguous")
    kernel = _kernels()
    kernel[(tokens, heads + kv_heads)](
        q,
        k,
        q_out,
        k_out,
        v,
        flat,
        blocks,
        offsets,
        rows if rows is not None else blocks,  # unread without TABLE
        cos.shape[0],
        cos,
        sin,
        q_weight,
        k_weight,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos.stride(0),
        sin.stride(0),
        v.stride(0),
        v.stride(1),
        flat.stride(0),
        flat.stride(1),
        rows_per_block,
        block_size,
        heads,
        eps,
        HEAD_DIM=head_dim,
        D_P=next_pow2(head_dim),
        ROTARY=rotary_dim,
        HALF=rotary_dim // 2,
        NORM=norms is not None,
        GEMMA=gemma,
        STORE=store is not None,
        TABLE=rows is not None,
        num_warps=1 if head_dim <= 128 else 2,
    )
    return q_out, k_out


@functools.cache
def _kernels() -> Any:
    """Import triton and jit the kernel source below in place (in this module's namespace)."""
    namespace = globals()
    jit_in_place(namespace, ("_norm_rope_kernel",), "norm + rope")
    return namespace["_norm_rope_kernel"]


# ---- kernel sources (jitted by _kernels) -----------------------------------------------------


def _norm_rope_kernel(
    q,
    k,
    q_out,
    k_out,
    v,
    cache,
    write_block,
    write_offset,
    positions,
    table_rows,
    cos,
    sin,
    q_weight,
    k_weight,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    rows_per_block,
    block_size,
    heads,
    eps,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    ROTARY: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    GEMMA: tl.constexpr,
    STORE: tl.constexpr,
    TABLE: tl.constexpr,
):
    """Program (token t, head h): h < heads is query head h, else key head h - heads (which,
    with ``STORE``, also writes the token's K and V rows of that head into the cache)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < heads:
        src = q + t * stride_qt + h * stride_qh
        dst = q_out + t * stride_qot + h * stride_qoh
        weight = q_weight
    else:
        src = k + t * stride_kt + (h - heads) * stride_kh
        dst = k_out + t * stride_kot + (h - heads) * stride_koh
        weight = k_weight
    d = tl.arange(0, D_P)
    ok = d < HEAD_DIM
    rotated = d < ROTARY
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    values = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    others = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(values * values, axis=0) / HEAD_DIM + eps)
        w = tl.load(weight + d, mask=ok, other=0.0).to(tl.float32)
        w_partner = tl.load(weight + partner, mask=rotated, other=0.0).to(tl.float32)
        dtype = dst.dtype.element_ty  # each value rounded where RMSNorm rounds it
        if GEMMA:
            values = (values * rstd * w).to(dtype).to(tl.float32)
            others = (others * rstd * w_partner).to(dtype).to(tl.float32)
        else:
            values = ((values * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
            others = ((others * rstd).to(dtype).to(tl.float32) * w_partner).to(dtype).to(tl.float32)
    row = t
    if TABLE:  # the token's position picks its table row (a pad row's position stays inside)
        row = tl.minimum(tl.load(positions + t).to(tl.int64), table_rows - 1)
    c = tl.load(cos + row * stride_cos + d, mask=rotated, other=0.0).to(tl.float32)
    s = tl.load(sin + row * stride_sin + d, mask=rotated, other=0.0).to(tl.float32)
    out = tl.where(rotated, values * c + others * s, values)
    tl.store(dst + d, out.to(dst.dtype.element_ty), mask=ok)
    if STORE:  # noqa: SIM102  # a constexpr branch (compiled out) around a runtime one
        if h >= heads:
            kh = h - heads
            key = tl.load(write_block + t).to(tl.int64) * rows_per_block + tl.load(write_offset + t).to(tl.int64)
            tl.store(cache + key * stride_ct + kh * stride_ch + d, out.to(cache.dtype.element_ty), mask=ok)
            value = tl.load(v + t * stride_vt + kh * stride_vh + d, mask=ok, other=0.0)
            tl.store(cache + (key + block_size) * stride_ct + kh * stride_ch + d, value, mask=ok)
