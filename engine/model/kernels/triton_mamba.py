"""The Mamba2 decode SSM update as one Triton kernel per layer (CUDA; the CPU runs it under
``TRITON_INTERPRET=1``, for tests).

``Mamba2Mixer._decode`` on the torch path gathers the decoding requests' SSM states a tile of
heads at a time, updates them, scatters them back and computes ``y`` (several launches per tile).
Here one launch does all of it for every decoding request of the step: program ``(i, h, p)``
reads rows ``p`` of head ``h``'s fp32 state ``[P, N]`` in block ``source[i]`` (zeros when
``fresh[i]``), computes ``h' = exp(dt * A[h]) h + dt x B`` with ``A = -exp(A_log)`` and the B/C of
head ``h``'s group (indexed, never repeated per head), writes ``h'`` to block ``target[i]`` and
``y = h' C + D[h] x`` straight into the request's row of the layer's output. A program reads its
state before writing it, so ``source[i] == target[i]`` is fine. Across programs there is no
order: a block one request reads must not be another request's write block in the same step,
which the coordinator guarantees (a step writes a request's state only into a block of its own,
a new one or its live tail; a shared cached state block is only ever read, see
``engine.kv_cache.mamba_manager``). The conv window step stays in torch.

Status: this kernel has only run under Triton's interpreter (CPU); it has never run compiled on
a GPU. So an unset ``KVFLEET_MAMBA_KERNEL`` means the torch path everywhere for now. A GPU
session must first run tests/model/test_triton_mamba.py compiled (it runs on CUDA when there is
one), then make unset mean "CUDA with triton available", as ``triton_attention.enabled`` does.

Triton is imported and the kernel is jitted on first use (``_kernels``), so this module imports
without triton and ``TRITON_INTERPRET`` is read at first use, not at import.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.model.kernels.triton_attention import jit_in_place, kernel_choice, next_pow2

ENV = "KVFLEET_MAMBA_KERNEL"
TILE_ELEMENTS = 4096  # fp32 state values one program holds ([BLOCK_P, N_P]): 32 registers a thread at 4 warps
tl: Any = None  # triton.language, bound by _kernels()


def enabled(device: torch.device) -> bool:
    """Whether ``Mamba2Mixer._decode`` on ``device`` runs the kernel (``kernel_choice`` of
    ``KVFLEET_MAMBA_KERNEL``); unset means the torch path everywhere until the kernel has run
    compiled (module docstring)."""
    return kernel_choice(ENV, device, False)


def ssm_decode_update(
    ssm_state: torch.Tensor,
    source: torch.Tensor,
    fresh: torch.Tensor | None,
    target: torch.Tensor,
    x: torch.Tensor,
    step: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    a_log: torch.Tensor,
    d: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """One recurrence step for ``B`` decoding requests, in one launch.

    ``ssm_state``: fp32 ``[num_blocks, H, P, N]`` (any block stride, the rest contiguous); the
    other tensors may have any strides (the torch path's ``x``/``b``/``c`` are column-major);
    ``source``/``target``: int64 ``[B]`` blocks to read and write; ``fresh``: bool ``[B]``
    (start from zeros) or None; ``x``: fp32 ``[B, H, P]``; ``step``: fp32 ``[B, H]`` (after
    softplus and clamp); ``b``/``c``: fp32 ``[B, G, N]``; ``a_log``/``d``: ``[H]``. Writes each
    request's new states into ``ssm_state[target[i]]`` and its ``y`` (``[H * P]``, ``D x``
    included) into ``out[rows[i]]``.
    """
    count, heads, head_dim = x.shape
    if count == 0:
        return
    n_groups, d_state = b.shape[1], b.shape[2]
    if ssm_state.dtype != torch.float32 or ssm_state.shape[1:] != (heads, head_dim, d_state):
        want = f"fp32 [*, {heads}, {head_dim}, {d_state}]"
        raise ValueError(f"ssm_decode_update: state {tuple(ssm_state.shape)} {ssm_state.dtype}, want {want}")
    if ssm_state.stride(3) != 1 or ssm_state.stride(2) != d_state or ssm_state.stride(1) != head_dim * d_state:
        raise ValueError("ssm_decode_update: each block's [H, P, N] state must be contiguous")
    n_pad = next_pow2(d_state)
    block_p = min(next_pow2(head_dim), max(1, TILE_ELEMENTS // n_pad))
    kernel = _kernels()
    kernel[(count, heads, -(-head_dim // block_p))](
        ssm_state,
        source,
        target,
        fresh if fresh is not None else source,
        x,
        step,
        b,
        c,
        a_log,
        d,
        out,
        rows,
        ssm_state.stride(0),
        *x.stride(),
        *step.stride(),
        *b.stride(),
        *c.stride(),
        *out.stride(),
        HEADS_PER_GROUP=heads // n_groups,
        HEAD_DIM=head_dim,
        D_STATE=d_state,
        BLOCK_P=block_p,
        N_P=n_pad,
        HAS_FRESH=fresh is not None,
        num_warps=4,
    )


@functools.cache
def _kernels() -> Any:
    """Import triton and jit the kernel source below in place (in this module's namespace)."""
    namespace = globals()
    jit_in_place(namespace, ("_ssm_decode_kernel",), "mamba decode")
    return namespace["_ssm_decode_kernel"]


# ---- kernel source (jitted by _kernels) ------------------------------------------------------


def _ssm_decode_kernel(
    state,
    source,
    target,
    fresh,
    x,
    step,
    b,
    c,
    a_log,
    d,
    out,
    rows,
    stride_block,
    stride_xb,
    stride_xh,
    stride_xp,
    stride_sb,
    stride_sh,
    stride_bb,
    stride_bg,
    stride_bn,
    stride_cb,
    stride_cg,
    stride_cn,
    stride_ob,
    stride_oc,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_STATE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    N_P: tl.constexpr,
    HAS_FRESH: tl.constexpr,
):
    """Program (request i, head h, row tile): rows ``[BLOCK_P * tile, + BLOCK_P)`` of head h's state."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N_P)
    p_ok = p < HEAD_DIM
    n_ok = n < D_STATE
    g = h // HEADS_PER_GROUP
    within = (h * HEAD_DIM + p)[:, None] * D_STATE + n[None, :]  # offset inside a block's [H, P, N]
    mask = p_ok[:, None] & n_ok[None, :]
    read_mask = mask
    if HAS_FRESH:
        read_mask = mask & (tl.load(fresh + i) == 0)  # a fresh request's state is zeros, not the block's
    src = tl.load(source + i).to(tl.int64)
    dst = tl.load(target + i).to(tl.int64)
    hs = tl.load(state + src * stride_block + within, mask=read_mask, other=0.0)
    dt = tl.load(step + i * stride_sb + h * stride_sh)
    rate = tl.exp(dt * -tl.exp(tl.load(a_log + h).to(tl.float32)))
    xs = tl.load(x + i * stride_xb + h * stride_xh + p * stride_xp, mask=p_ok, other=0.0)
    bs = tl.load(b + i * stride_bb + g * stride_bg + n * stride_bn, mask=n_ok, other=0.0)
    cs = tl.load(c + i * stride_cb + g * stride_cg + n * stride_cn, mask=n_ok, other=0.0)
    hs = hs * rate + (dt * xs)[:, None] * bs[None, :]
    tl.store(state + dst * stride_block + within, hs, mask=mask)
    y = tl.sum(hs * cs[None, :], axis=1) + tl.load(d + h).to(tl.float32) * xs
    row = tl.load(rows + i).to(tl.int64)
    tl.store(out + row * stride_ob + (h * HEAD_DIM + p) * stride_oc, y, mask=p_ok)
