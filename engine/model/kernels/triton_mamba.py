"""The Mamba2 decode step as two Triton kernels per layer (CUDA; the CPU runs them under
``TRITON_INTERPRET=1``, for tests and the benchmarks' kernel count).

``Mamba2Mixer._decode`` on the torch path gathers the decoding requests' conv windows, runs the
conv step, its bias and activation, the ``dt`` bias, softplus and clamp, then gathers the SSM
states a tile of heads at a time, updates them, scatters them back and computes ``y`` (a dozen
launches and more). Here it is two launches for every decoding request of the step, reading the
in-projection's output columns in place:

- ``conv_decode_update``: program ``(i, channel tile)`` reads the conv window of block
  ``source[i]`` (zeros when ``fresh[i]``), shifts in the request's new ``xBC`` row, writes the new
  window to block ``target[i]`` and the activated conv output ``silu(w . window + bias)`` to a
  ``[B, conv_dim]`` buffer;
- ``ssm_decode_update``: program ``(i, h, p)`` computes the head's step
  ``dt = clamp(softplus(dt_raw + dt_bias))`` from the request's raw ``dt`` row, reads rows ``p``
  of head ``h``'s fp32 state ``[P, N]`` in block ``source[i]`` (zeros when ``fresh[i]``),
  computes ``h' = exp(dt * A[h]) h + dt x B`` with ``A = -exp(A_log)`` and the B/C of head
  ``h``'s group (indexed, never repeated per head), writes ``h'`` to block ``target[i]`` and
  ``y = h' C + D[h] x`` straight into the request's row of the layer's output.

A program reads each value of its state before writing it (the conv kernel a column at a time,
each column loaded before the column it moves into is stored, by the same thread), so
``source[i] == target[i]`` is fine. Across programs there is no order: a block one request reads
must not be another request's write block in the same step, which the coordinator guarantees (a
step writes a request's state only into a block of its own, a new one or its live tail; a shared
cached state block is only ever read, see ``engine.kv_cache.mamba_manager``). Rows a CUDA graph
pads a decode batch with read and write the null block, as on the torch path.

Status: tests/model/test_triton_mamba.py has passed with the kernels compiled on an H200 (and
the GPU suite's engines ran Bamba on them), so an unset ``KVFLEET_MAMBA_KERNEL`` means "CUDA with
triton available", as ``triton_attention.enabled`` does; on the CPU they run only under the
interpreter, for tests.

Triton is imported and the kernels are jitted on first use (``_kernels``), so this module imports
without triton and ``TRITON_INTERPRET`` is read at first use, not at import.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.model.kernels.triton_attention import available, jit_in_place, kernel_choice, next_pow2

ENV = "KVFLEET_MAMBA_KERNEL"
TILE_ELEMENTS = 4096  # fp32 state values one program holds ([BLOCK_P, N_P]): 32 registers a thread at 4 warps
CONV_BLOCK = 256  # channels one conv program handles (its window columns are loaded one at a time)
tl: Any = None  # triton.language, bound by _kernels()


def enabled(device: torch.device) -> bool:
    """Whether ``Mamba2Mixer._decode`` on ``device`` runs the kernels (``kernel_choice`` of
    ``KVFLEET_MAMBA_KERNEL``); unset means CUDA with triton available (module docstring)."""
    return kernel_choice(ENV, device, device.type == "cuda" and available())


def conv_decode_update(
    conv_state: torch.Tensor,
    source: torch.Tensor,
    fresh: torch.Tensor | None,
    target: torch.Tensor,
    xbc: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The conv step of ``B`` decoding requests with its activation, in one launch.

    ``conv_state``: fp32 ``[num_blocks, C, K]`` (any block stride, each block's ``[C, K]``
    contiguous); ``source``/``target``: int64 ``[B]`` blocks to read and write; ``fresh``: bool
    ``[B]`` (start from a zero window) or None; ``xbc``: ``[T, C]``, any strides and float dtype
    (the in-projection's ``xBC`` columns), request ``i``'s new input in row ``rows[i]``;
    ``weight``: ``[C, 1, K]`` (the depthwise ``nn.Conv1d``'s); ``bias``: ``[C]`` or None. Writes
    each request's new window into ``conv_state[target[i]]`` and returns the activated conv
    output, fp32 ``[B, C]`` (contiguous).
    """
    count, (channels, width) = source.numel(), conv_state.shape[1:]
    out = torch.empty(count, channels, dtype=torch.float32, device=conv_state.device)
    if count == 0:
        return out
    if conv_state.dtype != torch.float32 or conv_state.stride(2) != 1 or conv_state.stride(1) != width:
        raise ValueError(f"conv_decode_update: state {tuple(conv_state.shape)} {conv_state.dtype}, want fp32 [*, C, K]")
    if xbc.shape[1] != channels or weight.shape[0] != channels or weight.shape[-1] != width:
        raise ValueError(f"conv_decode_update: xbc {tuple(xbc.shape)}, weight {tuple(weight.shape)} for C={channels}")
    block = min(CONV_BLOCK, next_pow2(channels))
    kernel = _kernels()[0]
    kernel[(count, -(-channels // block))](
        conv_state,
        source,
        target,
        fresh if fresh is not None else source,
        xbc,
        rows,
        weight,
        bias if bias is not None else weight,
        out,
        conv_state.stride(0),
        *xbc.stride(),
        weight.stride(0),
        weight.stride(-1),
        channels,
        WIDTH=width,
        BLOCK_C=block,
        HAS_FRESH=fresh is not None,
        HAS_BIAS=bias is not None,
        num_warps=4,
    )
    return out


def ssm_decode_update(
    ssm_state: torch.Tensor,
    source: torch.Tensor,
    fresh: torch.Tensor | None,
    target: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limits: tuple[float, float],
    b: torch.Tensor,
    c: torch.Tensor,
    a_log: torch.Tensor,
    d: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """One recurrence step for ``B`` decoding requests, in one launch.

    ``ssm_state``: fp32 ``[num_blocks, H, P, N]`` (any block stride, the rest contiguous); the
    other tensors may have any strides (``x``/``b``/``c`` are views of ``conv_decode_update``'s
    output, ``dt`` the in-projection's ``dt`` columns); ``source``/``target``: int64 ``[B]``
    blocks to read and write; ``fresh``: bool ``[B]`` (start from zeros) or None; ``x``: fp32
    ``[B, H, P]``; ``dt``: ``[T, H]`` raw (any float dtype), request ``i``'s in row ``rows[i]``;
    its step is ``clamp(softplus(dt + dt_bias), *dt_limits)``; ``b``/``c``: fp32 ``[B, G, N]``;
    ``dt_bias``/``a_log``/``d``: ``[H]``. Writes each request's new states into
    ``ssm_state[target[i]]`` and its ``y`` (``[H * P]``, ``D x`` included) into
    ``out[rows[i]]``.
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
    kernel = _kernels()[1]
    kernel[(count, heads, -(-head_dim // block_p))](
        ssm_state,
        source,
        target,
        fresh if fresh is not None else source,
        x,
        dt,
        dt_bias,
        b,
        c,
        a_log,
        d,
        out,
        rows,
        ssm_state.stride(0),
        *x.stride(),
        *dt.stride(),
        *b.stride(),
        *c.stride(),
        *out.stride(),
        float(dt_limits[0]),
        float(dt_limits[1]),
        HEADS_PER_GROUP=heads // n_groups,
        HEAD_DIM=head_dim,
        D_STATE=d_state,
        BLOCK_P=block_p,
        N_P=n_pad,
        HAS_FRESH=fresh is not None,
        num_warps=4,
    )


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Import triton and jit the kernel sources below in place (in this module's namespace)."""
    namespace = globals()
    jit_in_place(namespace, ("_softplus", "_conv_decode_kernel", "_ssm_decode_kernel"), "mamba decode")
    return namespace["_conv_decode_kernel"], namespace["_ssm_decode_kernel"]


# ---- kernel source (jitted by _kernels) ------------------------------------------------------


def _softplus(v):
    """torch's ``softplus`` (threshold 20): ``v`` above the threshold, else ``log1p(exp(v))``, the
    log1p exact for small ``exp(v)`` (``log(w) * u / (w - 1)`` with ``w = 1 + u``, which rounds
    like log1p; ``u`` itself where ``w`` rounds to 1)."""
    u = tl.exp(tl.minimum(v, 20.0))
    w = 1.0 + u
    small = w == 1.0
    log1p = tl.where(small, u, tl.log(w) * u / tl.where(small, 1.0, w - 1.0))
    return tl.where(v > 20.0, v, log1p)


def _conv_decode_kernel(
    state,
    source,
    target,
    fresh,
    xbc,
    rows,
    weight,
    bias,
    out,
    stride_block,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    channels,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Program (request i, channel tile): channels ``[BLOCK_C * tile, + BLOCK_C)``. Column ``k``
    of the new window is column ``k + 1`` of the old one (the new input last); each column is
    loaded before the column it moves into is stored, by the thread that holds its channel."""
    i = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = ch < channels
    read_ok = ok
    if HAS_FRESH:
        read_ok = ok & (tl.load(fresh + i) == 0)  # a fresh request's window is zeros, not the block's
    src = state + tl.load(source + i).to(tl.int64) * stride_block + ch * WIDTH
    dst = state + tl.load(target + i).to(tl.int64) * stride_block + ch * WIDTH
    taps = weight + ch * stride_wc
    conv = tl.zeros([BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(WIDTH - 1):
        column = tl.load(src + k + 1, mask=read_ok, other=0.0)
        conv += column * tl.load(taps + k * stride_wk, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst + k, column, mask=ok)
    row = tl.load(rows + i).to(tl.int64)
    new = tl.load(xbc + row * stride_xt + ch * stride_xc, mask=ok, other=0.0).to(tl.float32)
    conv += new * tl.load(taps + (WIDTH - 1) * stride_wk, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst + WIDTH - 1, new, mask=ok)
    if HAS_BIAS:
        conv += tl.load(bias + ch, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + i * channels + ch, conv / (1.0 + tl.exp(-conv)), mask=ok)  # silu


def _ssm_decode_kernel(
    state,
    source,
    target,
    fresh,
    x,
    dt_raw,
    dt_bias,
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
    stride_dt,
    stride_dh,
    stride_bb,
    stride_bg,
    stride_bn,
    stride_cb,
    stride_cg,
    stride_cn,
    stride_ob,
    stride_oc,
    dt_min,
    dt_max,
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
    row = tl.load(rows + i).to(tl.int64)
    hs = tl.load(state + src * stride_block + within, mask=read_mask, other=0.0)
    dt = tl.load(dt_raw + row * stride_dt + h * stride_dh).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
    dt = tl.minimum(tl.maximum(_softplus(dt), dt_min), dt_max)
    rate = tl.exp(dt * -tl.exp(tl.load(a_log + h).to(tl.float32)))
    xs = tl.load(x + i * stride_xb + h * stride_xh + p * stride_xp, mask=p_ok, other=0.0)
    bs = tl.load(b + i * stride_bb + g * stride_bg + n * stride_bn, mask=n_ok, other=0.0)
    cs = tl.load(c + i * stride_cb + g * stride_cg + n * stride_cn, mask=n_ok, other=0.0)
    hs = hs * rate + (dt * xs)[:, None] * bs[None, :]
    tl.store(state + dst * stride_block + within, hs, mask=mask)
    y = tl.sum(hs * cs[None, :], axis=1) + tl.load(d + h).to(tl.float32) * xs
    tl.store(out + row * stride_ob + (h * HEAD_DIM + p) * stride_oc, y, mask=p_ok)
