"""Decode attention with each token's keys split over several programs, combined in the same
launch (CUDA; the CPU runs it under ``TRITON_INTERPRET=1``, for tests).

``triton_attention``'s kernel gives a decode token one program per KV head, which walks every key
of the token's context in turn. With few tokens and few KV heads that is a few programs on a GPU
of a hundred-odd SMs: Gemma-3-270M (one KV head) decoding one request runs one program per layer,
and that kernel was half of an H200 decode step's GPU time (``benchmarks/README.md``, "On one
GPU"). Here program (token, KV head, split) takes an equal share of the token's key range
(``BLOCK_N``-aligned), and writes its running max, denominator and weighted values (the online
softmax's state, in fp32) to a scratch row; then it adds one to the (token, KV head)'s counter,
and the program that finds itself last reads every share, combines them (each rescaled to the
common max) and writes the output, and sets the counter back to 0 for the next launch. So the
split costs no second launch (the kernel count stays that of ``triton_attention``), and a captured
decode step replays it as it is (the counters live with the layer, made before any capture).

The number of splits is fixed by the launch's shape (the tokens, KV heads and block-table width:
``splits_for``), not by the tokens' positions, so a captured bucket always launches the same grid;
a share past a token's keys is empty (max -inf, weight 0).

Whether the runner uses it follows ``KVFLEET_SPLIT_DECODE`` (``triton_attention.kernel_choice``):
unset means off, until a GPU run has checked it compiled (its ordering rests on the atomic's
acquire/release, which the interpreter, running programs one after another, cannot show).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.model.kernels.triton_attention import PagedMeta, jit_in_place, kernel_choice, launch_config

ENV = "KVFLEET_SPLIT_DECODE"
#: counters a layer holds: one per (token, KV head) of a launch; a larger launch takes the plain kernel
COUNTERS = 4096
#: programs a launch aims at (about two per SM of an H200)
TARGET_PROGRAMS = 256
#: most splits of one token's keys, and fewest keys (four ``BLOCK_N`` tiles) a split is given
MAX_SPLITS = 16
MIN_SPLIT_KEYS = 256
tl: Any = None  # triton.language, bound by _kernels()


def enabled(device: torch.device) -> bool:
    """Whether decode attention on ``device`` splits its keys (``kernel_choice`` of
    ``KVFLEET_SPLIT_DECODE``): unset means off (module docstring)."""
    return kernel_choice(ENV, device, False)


def make_counters(device: torch.device) -> torch.Tensor | None:
    """A layer's counters where the split path is on (zeros; each launch leaves them zero)."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device) if enabled(device) else None


def splits_for(num_tokens: int, kv_heads: int, max_keys: int) -> int:
    """Splits of each token's keys for a launch of ``num_tokens`` decode tokens whose block
    tables reach ``max_keys`` keys: enough programs to fill the GPU, each split at least
    ``MIN_SPLIT_KEYS`` keys of the longest context."""
    wanted = -(-TARGET_PROGRAMS // max(1, num_tokens * kv_heads))
    return max(1, min(MAX_SPLITS, wanted, max_keys // MIN_SPLIT_KEYS))


def split_decode(
    q: torch.Tensor,
    flat: torch.Tensor,
    rows_per_block: int,
    block_size: int,
    meta: PagedMeta,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    counters: torch.Tensor,
) -> torch.Tensor | None:
    """``triton_attention.paged_attention_triton``'s result for a launch of decode tokens only
    (every tile one row), with the keys split (``splits_for``); None where that does not apply (a
    prompt tile, one split, or more (token, KV head) pairs than ``counters``), and the caller
    runs the plain kernel."""
    tokens, heads, head_dim = q.shape
    kv_heads = flat.shape[1]
    pairs = meta.num_tiles * kv_heads
    if meta.num_tiles == 0 or meta.max_tile_rows != 1 or pairs > counters.numel():
        return None
    splits = splits_for(meta.num_tiles, kv_heads, meta.tables.shape[1] * block_size)
    if splits == 1:
        return None
    if flat.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("split_decode: head_dim must be the contiguous dimension")
    config = launch_config(heads // kv_heads, head_dim, q.dtype)
    rows, d_pad = config["DEC_ROWS"], config["D_P"]
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    part_max = torch.empty((pairs * splits, rows), dtype=torch.float32, device=q.device)
    part_sum = torch.empty((pairs * splits, rows), dtype=torch.float32, device=q.device)
    part_acc = torch.empty((pairs * splits, rows, d_pad), dtype=torch.float32, device=q.device)
    window = meta.window
    _kernels()[(meta.num_tiles, kv_heads, splits)](
        q,
        out,
        flat,
        meta.tiles,
        meta.tables,
        sinks if sinks is not None else q,
        part_max,
        part_sum,
        part_acc,
        counters,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        flat.stride(0),
        flat.stride(1),
        meta.tables.shape[1],
        rows_per_block,
        block_size,
        window or 1 << 30,
        kv_heads,
        scale,
        softcap or 1.0,
        SPLITS=splits,
        G=config["G"],
        G_P=config["G_P"],
        HEAD_DIM=head_dim,
        D_P=d_pad,
        ROWS=rows,
        BLOCK_N=config["BLOCK_N"],
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        PRECISION=config["PRECISION"],
        num_warps=config["num_warps"],
    )
    return out


@functools.cache
def _kernels() -> Any:
    """Import triton and jit the kernel source below in place (in this module's namespace)."""
    namespace = globals()
    jit_in_place(namespace, ("_capped", "_split_decode_kernel"), "split decode attention")
    return namespace["_split_decode_kernel"]


# ---- kernel sources (jitted by _kernels) -----------------------------------------------------


def _capped(s, softcap):
    """``softcap * tanh(s / softcap)`` (tanh as ``triton_attention``'s: through exp2)."""
    x = s / softcap
    return (1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)) * softcap


def _split_decode_kernel(
    q,
    out,
    cache,
    tiles,
    tables,
    sinks,
    part_max,
    part_sum,
    part_acc,
    counters,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_row,
    stride_head,
    table_width,
    rows_per_block,
    block_size,
    window,
    kv_heads,
    scale,
    softcap,
    SPLITS: tl.constexpr,
    G: tl.constexpr,
    G_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile, KV head, split): matrix row m < G is query head ``kvh * G + m`` of the
    tile's one token; the split's keys are ``[begin, end)`` of the token's ``[lo, pos]``."""
    LOG2E: tl.constexpr = 1.4426950408889634
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    fields = tiles + tile * 5
    table = tables + tl.load(fields).to(tl.int64) * table_width - tl.load(fields + 4)
    qrow = tl.load(fields + 1).to(tl.int64)
    pos = tl.load(fields + 2)
    m_idx = tl.arange(0, ROWS)
    head = kvh * G + m_idx
    row_ok = m_idx < G
    d = tl.arange(0, D_P)
    d_ok = d < HEAD_DIM
    query = tl.load(q + qrow * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None] & d_ok[None, :])
    lo = tl.maximum(pos - window + 1, 0)
    share = tl.cdiv(tl.cdiv(pos + 1 - lo, SPLITS), BLOCK_N) * BLOCK_N
    begin = lo + split * share
    end = tl.minimum(begin + share, pos + 1)
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_P], tl.float32)
    for start in range(begin, end, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < end
        block = tl.load(table + key_pos // block_size, mask=key_ok, other=0).to(tl.int64)
        key_rows = block * rows_per_block + key_pos % block_size
        k_ptrs = cache + key_rows[:, None] * stride_row + kvh * stride_head + d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        keys = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        values = tl.load(k_ptrs + block_size * stride_row, mask=kv_mask, other=0.0)
        s = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * scale
        if HAS_SOFTCAP:
            s = _capped(s, softcap)
        s = tl.where(key_ok[None, :], s * LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
        m_i = m_new
    pair = tile * kv_heads + kvh
    slot = (pair * SPLITS + split).to(tl.int64)
    tl.store(part_max + slot * ROWS + m_idx, m_i)
    tl.store(part_sum + slot * ROWS + m_idx, l_i)
    tl.store(part_acc + (slot * ROWS + m_idx)[:, None] * D_P + d[None, :], acc)
    arrived = tl.atomic_add(counters + pair, 1, sem="acq_rel")
    if arrived == SPLITS - 1:  # the last share of this (token, KV head): combine them all
        first = (pair * SPLITS).to(tl.int64)
        if HAS_SINKS:  # the sink: a logit with weight and no value, once
            sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            top = sink
        else:
            top = tl.full([ROWS], -1.0e30, tl.float32)
        for s_i in range(SPLITS):
            top = tl.maximum(top, tl.load(part_max + (first + s_i) * ROWS + m_idx, cache_modifier=".cg"))
        total = tl.zeros([ROWS], tl.float32)
        if HAS_SINKS:
            total = tl.exp2(sink - top)
        weighted = tl.zeros([ROWS, D_P], tl.float32)
        for s_i in range(SPLITS):
            row = (first + s_i) * ROWS + m_idx
            scale_i = tl.exp2(tl.load(part_max + row, cache_modifier=".cg") - top)
            total += tl.load(part_sum + row, cache_modifier=".cg") * scale_i
            share_acc = tl.load(part_acc + row[:, None] * D_P + d[None, :], cache_modifier=".cg")
            weighted += share_acc * scale_i[:, None]
        total = tl.where(total == 0.0, 1.0, total)
        o_ptrs = out + qrow * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, (weighted / total[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.atomic_xchg(counters + pair, 0)
