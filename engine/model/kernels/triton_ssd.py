"""The packed chunked SSD scan of Mamba2's prefill as three Triton kernels (CUDA; the CPU runs
them under ``TRITON_INTERPRET=1``, for tests).

``engine.model.layers.ssd.ssd_scan_packed`` (the reference, and the torch path) loops in Python
over the sub-chunks of ``SUB_CHUNK`` tokens with about twenty torch operations each, so a long
prompt costs hundreds of small launches per Mamba2 layer. Here the same scan is three launches
whatever the prompt lengths, over the sub-chunks of ``PackedChunks.sub_chunks`` (each chunk cut
at its own start every ``SUB_CHUNK`` tokens, the last piece shorter), with ``L_t`` the cumulative
log decay ``sum_{s <= t} dt_s a`` from the sub-chunk's start:

- ``_chunk_state_kernel``, program (sub-chunk k, head, state tile): what the sub-chunk adds to the
  state, ``u_k = sum_s exp(L_end - L_s) dt_s x_s B_s^T``, and its total log decay ``L_end``;
- ``_state_pass_kernel``, program (chunk, head, state tile): walks the chunk's sub-chunks in order,
  ``h_k = exp(L_end_k) h_{k-1} + u_k`` from the chunk's initial state (zeros when ``h`` is None),
  overwriting each ``u_k`` with the state entering sub-chunk k and writing the final state;
- ``_chunk_scan_kernel``, program (sub-chunk, head, tile of head_dim): the outputs
  ``y_t = sum_{s <= t} (C_t . B_s) exp(L_t - L_s) dt_s x_s + exp(L_t) C_t . h_in``.

A state tile is ``[BLOCK_P, BLOCK_N]`` of a head's ``[P, N]`` state; the two passes over states
keep their ``[S, H, P, N]`` fp32 buffer (``u_k``, then the states entering each sub-chunk), about
``num_tokens / 64 * H * P * N * 4`` bytes (200 MB for an 8192-token step of the bench's Bamba
shape, 48 heads of 64 with d_state 128: benchmarks/engine_gpu.py) besides ``[S, H]`` decays.

Every product and sum is in fp32 (inputs may be fp32 or 16-bit); ``tl.dot`` runs in IEEE fp32
on fp32 inputs and TF32 on 16-bit ones, as ``triton_attention.launch_config`` chooses. A head's
B and C are its group's, indexed, never repeated per head.

Status: opt-in. ``KVFLEET_SSD_KERNEL=triton`` turns it on (``triton_attention.kernel_choice``);
unset means off on every device, CUDA included, until the GPU suite (its ``triton`` stage runs
tests/model/test_triton_ssd.py) has passed with the kernels compiled; so far they have only run
under the interpreter. The tile sizes and warp counts below are guesses no GPU has measured.

Triton is imported and the kernels are jitted on first use (``_kernels``), so this module imports
without triton and ``TRITON_INTERPRET`` is read at first use, not at import.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.model.kernels.triton_attention import jit_in_place, kernel_choice, next_pow2
from engine.model.layers.ssd import SUB_CHUNK, PackedChunks

ENV = "KVFLEET_SSD_KERNEL"
#: a state tile is [BLOCK_P, BLOCK_N] of a head's [P, N] state: at most these (powers of two, >= 16,
#: ``tl.dot``'s least); ``_chunk_scan_kernel`` walks d_state BLOCK_N columns at a time
MAX_BLOCK_P = 64
MAX_BLOCK_N = 64
tl: Any = None  # triton.language, bound by _kernels()


def enabled(device: torch.device) -> bool:
    """Whether ``Mamba2Mixer._prefill`` on ``device`` runs the kernels (``kernel_choice`` of
    ``KVFLEET_SSD_KERNEL``): unset means off everywhere (module docstring)."""
    return kernel_choice(ENV, device, False)


def ssd_scan_packed(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    h: torch.Tensor | None,
    packed: PackedChunks,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``engine.model.layers.ssd.ssd_scan_packed`` computes, in three launches.

    x: [num_tokens, G, E, P]; dt: [num_tokens, G, E] (the steps, already softplus'd); a: [G, E]
    (negative); b, c: [num_tokens, G, N]; all with any strides and float dtype. h: [R, G, E, P,
    N], the states before the chunks (any strides), or None when they are all zero. Returns y
    [num_tokens, G, E, P] in x's dtype (without the D skip) and the states after the chunks:
    written into ``h`` when it is given (as the reference does), else a new tensor in x's dtype.
    Invariant (``pack_chunks``'s): chunk j's tokens are packed rows ``starts[j] ..`` of the
    inputs, and ``packed.sub_chunks`` cuts each chunk at its own start.
    """
    tokens, groups, heads_per_group, head_dim = x.shape
    count, d_state = len(packed.lengths), b.shape[-1]
    heads = groups * heads_per_group
    if tokens != sum(packed.lengths):
        raise ValueError(f"ssd_scan_packed: {tokens} tokens, the packing holds {sum(packed.lengths)}")
    if dt.shape != x.shape[:3] or a.shape != x.shape[1:3] or b.shape != (tokens, groups, d_state) or c.shape != b.shape:
        shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in (("dt", dt), ("a", a), ("b", b), ("c", c)))
        raise ValueError(f"ssd_scan_packed: x {tuple(x.shape)} with {shapes}")
    final = h if h is not None else x.new_empty(count, groups, heads_per_group, head_dim, d_state)
    if final.shape != (count, groups, heads_per_group, head_dim, d_state):
        raise ValueError(f"ssd_scan_packed: h {tuple(final.shape)} for {count} chunks of x {tuple(x.shape)}")
    assert packed.sub_chunks is not None and packed.chunk_spans is not None, "packed with table=False"
    sub_chunks = packed.sub_chunks.shape[0]
    states = torch.empty(sub_chunks, heads, head_dim, d_state, dtype=torch.float32, device=x.device)
    decay = torch.empty(sub_chunks, heads, dtype=torch.float32, device=x.device)
    y = x.new_empty(x.shape)
    block_p = max(16, min(next_pow2(head_dim), MAX_BLOCK_P))
    block_n = max(16, min(next_pow2(d_state), MAX_BLOCK_N))
    p_tiles, n_tiles = -(-head_dim // block_p), -(-d_state // block_n)
    shape = {
        "HEADS_PER_GROUP": heads_per_group,
        "HEAD_DIM": head_dim,
        "D_STATE": d_state,
        "BLOCK_T": SUB_CHUNK,
        "BLOCK_P": block_p,
        "BLOCK_N": block_n,
        "N_TILES": n_tiles,
    }
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    chunk_state, state_pass, chunk_scan = _kernels()
    chunk_state[(sub_chunks, heads, p_tiles * n_tiles)](
        x,
        dt,
        a,
        b,
        packed.sub_chunks,
        states,
        decay,
        *x.stride(),
        *dt.stride(),
        *a.stride(),
        *b.stride(),
        **shape,
        PRECISION=precision,
        num_warps=4,
    )
    state_pass[(count, heads, p_tiles * n_tiles)](
        states,
        decay,
        packed.chunk_spans,
        final,
        *final.stride(),
        **shape,
        HAS_INITIAL=h is not None,
        num_warps=4,
    )
    chunk_scan[(sub_chunks, heads, p_tiles)](
        x,
        dt,
        a,
        b,
        c,
        packed.sub_chunks,
        states,
        y,
        *x.stride(),
        *dt.stride(),
        *a.stride(),
        *b.stride(),
        *c.stride(),
        *y.stride(),
        **shape,
        PRECISION=precision,
        num_warps=4,
    )
    return y, final


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    """Import triton and jit the kernel sources below in place (in this module's namespace)."""
    namespace = globals()
    names = ("_log_decay", "_chunk_state_kernel", "_state_pass_kernel", "_chunk_scan_kernel")
    jit_in_place(namespace, names, "ssd scan")
    return namespace["_chunk_state_kernel"], namespace["_state_pass_kernel"], namespace["_chunk_scan_kernel"]


# ---- kernel source (jitted by _kernels) ------------------------------------------------------


def _log_decay(
    dt,
    a,
    first,
    length,
    head,
    stride_dt,
    stride_dg,
    stride_de,
    stride_ag,
    stride_ae,
    HEADS_PER_GROUP: tl.constexpr,
    T: tl.constexpr,
):
    """The sub-chunk's rows ``t`` (``[T]``, int64 packed rows), which of them hold tokens, the
    fp32 steps ``dt_t`` (0 past the last token) and ``L_t = sum_{s <= t} dt_s a`` (constant past
    the last token, since those steps are 0)."""
    g = head // HEADS_PER_GROUP
    e = head % HEADS_PER_GROUP
    t = tl.arange(0, T)
    ok = t < length
    rows = first.to(tl.int64) + t
    step = tl.load(dt + rows * stride_dt + g * stride_dg + e * stride_de, mask=ok, other=0.0).to(tl.float32)
    rate = tl.load(a + g * stride_ag + e * stride_ae).to(tl.float32)
    return rows, ok, step, tl.cumsum(step * rate, axis=0)


def _chunk_state_kernel(
    x,
    dt,
    a,
    b,
    sub_chunks,
    states,
    decay,
    stride_xt,
    stride_xg,
    stride_xe,
    stride_xp,
    stride_dt,
    stride_dg,
    stride_de,
    stride_ag,
    stride_ae,
    stride_bt,
    stride_bg,
    stride_bn,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_TILES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (sub-chunk k, head, state tile): one ``[BLOCK_P, BLOCK_N]`` tile of
    ``u_k = sum_s exp(L_end - L_s) dt_s x_s B_s^T`` into ``states[k, head]`` (fp32 ``[S, H, P,
    N]``, contiguous); the first tile also writes ``L_end`` to ``decay[k, head]``."""
    k = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    g = head // HEADS_PER_GROUP
    e = head % HEADS_PER_GROUP
    first = tl.load(sub_chunks + 2 * k)
    length = tl.load(sub_chunks + 2 * k + 1)
    rows, ok, step, log_decay = _log_decay(
        dt, a, first, length, head, stride_dt, stride_dg, stride_de, stride_ag, stride_ae, HEADS_PER_GROUP, BLOCK_T
    )
    t = tl.arange(0, BLOCK_T)
    last = tl.sum(tl.where(t == length - 1, log_decay, 0.0), axis=0)
    weight = tl.exp(last - log_decay) * step  # 0 past the last token
    p = tl.program_id(2) // N_TILES * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.program_id(2) % N_TILES * BLOCK_N + tl.arange(0, BLOCK_N)
    p_ok = p < HEAD_DIM
    n_ok = n < D_STATE
    x_ptr = x + rows[:, None] * stride_xt + g * stride_xg + e * stride_xe + p[None, :] * stride_xp
    xs = tl.load(x_ptr, mask=ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
    b_ptr = b + rows[:, None] * stride_bt + g * stride_bg + n[None, :] * stride_bn
    bs = tl.load(b_ptr, mask=ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    update = tl.dot(tl.trans(xs * weight[:, None]), bs, input_precision=PRECISION)  # [BLOCK_P, BLOCK_N]
    base = (k.to(tl.int64) * heads + head) * HEAD_DIM * D_STATE
    tl.store(states + base + p[:, None] * D_STATE + n[None, :], update, mask=p_ok[:, None] & n_ok[None, :])
    tl.store(decay + k * heads + head, last, mask=tl.program_id(2) == 0)


def _state_pass_kernel(
    states,
    decay,
    chunk_spans,
    final,
    stride_hr,
    stride_hg,
    stride_he,
    stride_hp,
    stride_hn,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_TILES: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
):
    """Program (chunk j, head, state tile): from ``final[j]``'s tile (the initial state when
    ``HAS_INITIAL``, else zeros), over the chunk's sub-chunks in order: read ``u_k``, overwrite
    it with the state entering sub-chunk k, carry ``h = exp(L_end_k) h + u_k``; then write the
    state after the chunk into ``final[j]`` (each value read before it is written, by the same
    program, so the initial and final states may share memory)."""
    j = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    g = head // HEADS_PER_GROUP
    e = head % HEADS_PER_GROUP
    p = tl.program_id(2) // N_TILES * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.program_id(2) % N_TILES * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (p < HEAD_DIM)[:, None] & (n < D_STATE)[None, :]
    h_ptr = final + j.to(tl.int64) * stride_hr + g * stride_hg + e * stride_he
    h_ptr += p[:, None] * stride_hp + n[None, :] * stride_hn
    if HAS_INITIAL:
        state = tl.load(h_ptr, mask=mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    first = tl.load(chunk_spans + 2 * j)
    count = tl.load(chunk_spans + 2 * j + 1)
    s_ptr = states + (first.to(tl.int64) * heads + head) * HEAD_DIM * D_STATE + p[:, None] * D_STATE + n[None, :]
    d_ptr = decay + first.to(tl.int64) * heads + head
    for _ in range(count):  # sub-chunks first .. first + count - 1, a stride of heads apart
        update = tl.load(s_ptr, mask=mask, other=0.0)
        tl.store(s_ptr, state, mask=mask)
        state = tl.exp(tl.load(d_ptr)) * state + update
        s_ptr += heads * HEAD_DIM * D_STATE
        d_ptr += heads
    tl.store(h_ptr, state.to(final.dtype.element_ty), mask=mask)


def _chunk_scan_kernel(
    x,
    dt,
    a,
    b,
    c,
    sub_chunks,
    states,
    y,
    stride_xt,
    stride_xg,
    stride_xe,
    stride_xp,
    stride_dt,
    stride_dg,
    stride_de,
    stride_ag,
    stride_ae,
    stride_bt,
    stride_bg,
    stride_bn,
    stride_ct,
    stride_cg,
    stride_cn,
    stride_yt,
    stride_yg,
    stride_ye,
    stride_yp,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_TILES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (sub-chunk k, head, column tile): columns ``[BLOCK_P * tile, + BLOCK_P)`` of the
    sub-chunk's outputs, ``y_t = sum_{s <= t} (C_t . B_s) exp(L_t - L_s) dt_s x_s + exp(L_t)
    C_t . h_in`` with ``h_in`` the state entering it (``states[k, head]`` after the pass); the
    products over d_state (``C_t . B_s``, ``C_t . h_in``) are summed ``BLOCK_N`` columns at a time."""
    k = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    g = head // HEADS_PER_GROUP
    e = head % HEADS_PER_GROUP
    first = tl.load(sub_chunks + 2 * k)
    length = tl.load(sub_chunks + 2 * k + 1)
    rows, ok, step, log_decay = _log_decay(
        dt, a, first, length, head, stride_dt, stride_dg, stride_de, stride_ag, stride_ae, HEADS_PER_GROUP, BLOCK_T
    )
    t = tl.arange(0, BLOCK_T)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < HEAD_DIM
    base = (k.to(tl.int64) * heads + head) * HEAD_DIM * D_STATE
    scores = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)  # [t, s]: C_t . B_s
    carried = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)  # C_t . h_in
    for tile in tl.static_range(N_TILES):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < D_STATE
        bc_mask = ok[:, None] & n_ok[None, :]
        cs = tl.load(c + rows[:, None] * stride_ct + g * stride_cg + n[None, :] * stride_cn, mask=bc_mask, other=0.0)
        bs = tl.load(b + rows[:, None] * stride_bt + g * stride_bg + n[None, :] * stride_bn, mask=bc_mask, other=0.0)
        cs = cs.to(tl.float32)
        scores += tl.dot(cs, tl.trans(bs.to(tl.float32)), input_precision=PRECISION)
        h_mask = p_ok[:, None] & n_ok[None, :]
        h_in = tl.load(states + base + p[:, None] * D_STATE + n[None, :], mask=h_mask, other=0.0)
        carried += tl.dot(cs, tl.trans(h_in), input_precision=PRECISION)
    causal = t[:, None] >= t[None, :]
    scores *= tl.exp(tl.where(causal, log_decay[:, None] - log_decay[None, :], float("-inf"))) * step[None, :]
    x_ptr = x + rows[:, None] * stride_xt + g * stride_xg + e * stride_xe + p[None, :] * stride_xp
    xs = tl.load(x_ptr, mask=ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
    ys = tl.dot(scores, xs, input_precision=PRECISION) + tl.exp(log_decay)[:, None] * carried  # [t, BLOCK_P]
    y_ptr = y + rows[:, None] * stride_yt + g * stride_yg + e * stride_ye + p[None, :] * stride_yp
    tl.store(y_ptr, ys.to(y.dtype.element_ty), mask=ok[:, None] & p_ok[None, :])
