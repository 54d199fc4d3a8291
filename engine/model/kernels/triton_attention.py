"""Paged attention reading KV in place through block tables: Triton kernels (CUDA; the CPU runs
them under ``TRITON_INTERPRET=1``, for tests).

The cache layout is ``layers.attention.paged_attention``'s: ``flat`` rows ``[num_blocks * rows_per_block,
kv_heads, head_dim]``, block b's page starting at row ``rows_per_block * b`` with ``block_size``
key rows then ``block_size`` value rows. One launch per layer serves a mixed step: every prefill
chunk is cut into query tiles and every decode token is a 1-row tile (``PagedMeta``), and each
program attends one tile of one KV head: its ``G`` query heads are folded into the tile's rows
(row = token * G_P + head) so each K/V tile is loaded once per head group, gathered row by row
through the block table; online softmax in fp32.

Triton is imported and the kernels are jitted on first use (``_kernels``): the sources below are
plain functions until then, so this module imports without triton and ``TRITON_INTERPRET`` is
read at first use, not at import.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from engine.model.uploads import upload

logger = logging.getLogger(__name__)

TILE_TOKENS = 128  # query rows of one host tile (programs split it further, by head group)
_NO_WINDOW = 1 << 30  # a window no sequence reaches: the kernel masks with one formula
_TILE_FIELDS = 5  # (table row, first query row in the batch, its position, rows, first table block)
tl: Any = None  # triton.language, bound by _kernels()


class ChunkSlice(Protocol):
    """What the kernels read of one request's slice of the step (``engine.model.batch.ChunkSpec``
    is one): its first token's index in the flattened batch, its first position, its length."""

    @property
    def offset(self) -> int: ...

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


def available() -> bool:
    """Whether triton imports here (the kernels themselves are jitted at first use)."""
    return _import_triton() is not None


@functools.cache
def _import_triton() -> Any:
    try:
        import triton
    except ImportError:
        return None
    return triton


def kernel_choice(variable: str, device: torch.device, when_unset: bool) -> bool:
    """The rule every Triton kernel of the engine follows: ``<variable>=triton`` forces the kernel
    (on the CPU only under ``TRITON_INTERPRET=1``), ``=torch`` forces the torch path, another
    value is an error naming the variable, and unset gives ``when_unset``."""
    choice = os.environ.get(variable, "").strip().lower()
    if choice == "torch":
        return False
    if choice == "triton":
        if not available():
            raise RuntimeError(f"{variable}=triton: triton is not importable")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{variable}=triton on {device.type} needs TRITON_INTERPRET=1")
        return True
    if choice:
        raise ValueError(f"{variable}: {choice!r} is not one of triton, torch")
    return when_unset


def enabled(device: torch.device) -> bool:
    """Whether the runner on ``device`` uses this path (``kernel_choice`` of
    ``KVFLEET_ATTENTION``): unset means CUDA with triton available."""
    return kernel_choice("KVFLEET_ATTENTION", device, device.type == "cuda" and available())


@dataclass(frozen=True)
class PagedMeta:
    """One KV group's query tiles and block tables for one step, on the device.

    Owns ``packed`` (int32, built on the host and copied once) and two views of it: ``tiles``
    ``[num_tiles, 5]`` = (table row, first query row in the batch, that row's position, rows,
    first block in the table row) and ``tables`` ``[num_chunks, width]``: each chunk's block
    table from block ``first`` (the first one its keys reach) on, padded with block 0.
    Invariants: a tile's rows are consecutive tokens of one chunk (at most ``TILE_TOKENS``; a
    decode token is a 1-row tile), tiles are ordered by decreasing work, and every table row
    covers its chunk's keys ``[lo, last position]``; the kernel loads no entry outside that.
    """

    packed: torch.Tensor
    tiles: torch.Tensor
    tables: torch.Tensor
    num_tiles: int
    max_tile_rows: int
    window: int | None


def build_paged_meta(
    chunks: Sequence[ChunkSlice], tables: list[list[int]], block_size: int, window: int | None, device: torch.device
) -> PagedMeta:
    """``tables[i]``: chunk i's block table; keys reach back ``window - 1`` positions (None: to 0)."""
    tiles: list[tuple[int, list[int]]] = []  # (work, fields)
    firsts: list[int] = []
    lasts: list[int] = []
    for c, chunk in enumerate(chunks):
        lo = max(0, chunk.start - window + 1) if window else 0
        firsts.append(lo // block_size)
        lasts.append((chunk.start + chunk.num_tokens - 1) // block_size)
        for row in range(0, chunk.num_tokens, TILE_TOKENS):
            rows = min(TILE_TOKENS, chunk.num_tokens - row)
            pos = chunk.start + row
            work = rows * (pos + rows - (max(0, pos - window + 1) if window else 0))
            tiles.append((work, [c, chunk.offset + row, pos, rows, firsts[c]]))
    tiles.sort(key=lambda tile: -tile[0])  # longest first: the short tail fills the last wave
    width = max((last - first + 1 for first, last in zip(firsts, lasts, strict=True)), default=1)
    packed = [field for _, fields in tiles for field in fields]
    for table, first, last in zip(tables, firsts, lasts, strict=True):
        if len(table) <= last:
            raise ValueError(f"block table of {len(table)} blocks does not reach block {last}")
        packed.extend(table[first : last + 1])
        packed.extend([0] * (width - (last + 1 - first)))
    data = upload(torch.from_numpy(np.array(packed, dtype=np.int32)), device)  # numpy: 3x torch.tensor(list)
    split = len(tiles) * _TILE_FIELDS
    return PagedMeta(
        packed=data,
        tiles=data[:split].view(len(tiles), _TILE_FIELDS),
        tables=data[split:].view(len(chunks), width),
        num_tiles=len(tiles),
        max_tile_rows=max((fields[3] for _, fields in tiles), default=0),
        window=window,
    )


def store_kv(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor, block_size: int) -> None:
    """Write token t's K to ``flat[key_rows[t]]`` and its V to ``flat[key_rows[t] + block_size]``
    (one kernel; ``k``/``v``: [T, kv_heads, head_dim])."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    kv_heads, head_dim = flat.shape[1], flat.shape[2]
    h_pad, d_pad = next_pow2(kv_heads), next_pow2(head_dim)
    block_t = max(1, min(16, 4096 // (h_pad * d_pad)))  # tokens per program
    _, store = _kernels()
    store[(-(-tokens // block_t),)](
        flat,
        k,
        v,
        key_rows,
        tokens,
        flat.stride(0),
        flat.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        block_size,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        H_P=h_pad,
        D_P=d_pad,
        BLOCK_T=block_t,
    )


def paged_attention_triton(
    q: torch.Tensor,
    flat: torch.Tensor,
    rows_per_block: int,
    block_size: int,
    meta: PagedMeta,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """Each query token (``q``: [T, heads, head_dim]) attends to its request's keys at positions
    ``[max(0, pos - window + 1), pos]`` read from ``flat`` through ``meta``'s block tables, with
    logit softcap and per-head sinks (``sinks``: [heads], a logit with no value) as in
    ``layers.attention._attend``. Returns [T, heads, head_dim] in ``q``'s dtype."""
    tokens, heads, head_dim = q.shape
    kv_heads = flat.shape[1]
    if flat.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("paged_attention_triton: head_dim must be the contiguous dimension")
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if meta.num_tiles == 0:
        return out
    config = launch_config(heads // kv_heads, head_dim, q.dtype)
    split = -(-min(meta.max_tile_rows, TILE_TOKENS) // config["TOKENS"])
    kernel, _ = _kernels()
    kernel[(meta.num_tiles * split, kv_heads)](
        q,
        out,
        flat,
        meta.tiles,
        meta.tables,
        sinks if sinks is not None else q,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        flat.stride(0),
        flat.stride(1),
        meta.tables.shape[1],
        rows_per_block,
        block_size,
        window or _NO_WINDOW,
        split,
        scale,
        softcap or 1.0,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        **config,
    )
    return out


def launch_config(groups: int, head_dim: int, dtype: torch.dtype) -> dict[str, Any]:
    """Tile shapes and launch options. A program's matrix has ``BLOCK_M`` rows (``TOKENS`` query
    tokens x ``G_P`` heads; 128 for 16-bit head dims up to 128, else 64, bounded by the fp32
    accumulator's registers) or ``DEC_ROWS`` for a part of few tokens (decode); keys come
    ``BLOCK_N`` at a time. On an H200 (bf16, GQA 4, head_dim 128) 4 warps beat 8 by 1.5x on
    decode and 1.1x on prefill, and ``BLOCK_N`` 64 beat 32 and 128 on mixed steps; head_dim 256
    wants 8 warps (1.2x)."""
    g_pad, d_pad = next_pow2(groups), max(16, next_pow2(head_dim))
    max_rows = 128 if d_pad <= 128 and dtype != torch.float32 else 64
    tokens = max(1, min(TILE_TOKENS, max_rows // g_pad))
    return {
        "G": groups,
        "G_P": g_pad,
        "HEAD_DIM": head_dim,
        "D_P": d_pad,
        "TOKENS": tokens,
        "BLOCK_M": max(16, tokens * g_pad),
        "DEC_ROWS": max(16, g_pad),
        "BLOCK_N": 64,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "num_warps": 4 if d_pad <= 128 else 8,
        "num_stages": 2,
    }


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Import triton and jit the kernel sources below in place (helpers are called by their
    global names, so the jitted objects replace them in this module's namespace)."""
    namespace = globals()
    jit_in_place(namespace, ("_tanh", "_attend_tile", "_paged_attention_kernel", "_store_kv_kernel"), "paged attention")
    return namespace["_paged_attention_kernel"], namespace["_store_kv_kernel"]


def jit_in_place(namespace: dict[str, Any], names: tuple[str, ...], what: str) -> None:
    """Import triton, bind ``tl`` in ``namespace`` (a kernel module's globals) and replace each
    named kernel source there by its jitted version: the engine's Triton modules import without
    triton, and a kernel calls its helpers by their global names."""
    triton = _import_triton()
    if triton is None:
        raise RuntimeError(f"triton {what}: triton is not importable")
    from triton import language

    if os.environ.get("TRITON_INTERPRET") == "1":
        from engine.model.kernels.interpreter import patch_interpreter

        patch_interpreter()
    namespace["tl"] = language
    for name in names:
        namespace[name] = triton.jit(namespace[name])
    logger.debug("triton %s jitted (interpreter: %s)", what, os.environ.get("TRITON_INTERPRET"))


# ---- kernel sources (jitted by _kernels) -----------------------------------------------------


def _store_kv_kernel(
    cache,
    k,
    v,
    rows,
    tokens,
    stride_row,
    stride_head,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    block_size,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_P: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, H_P * D_P)  # (head, dim) flattened
    h, d = e // D_P, e % D_P
    t_ok = t < tokens
    row = tl.load(rows + t, mask=t_ok, other=0).to(tl.int64)
    mask = t_ok[:, None] & ((h < KV_HEADS) & (d < HEAD_DIM))[None, :]
    dst = cache + row[:, None] * stride_row + (h * stride_head + d)[None, :]
    key = tl.load(k + t[:, None] * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    value = tl.load(v + t[:, None] * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    tl.store(dst, key, mask=mask)
    tl.store(dst + block_size * stride_row, value, mask=mask)


def _tanh(x):
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e): exp(2x) - 1 over exp(2x) + 1


def _paged_attention_kernel(
    q,
    out,
    cache,
    tiles,
    tables,
    sinks,
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
    split,
    scale,
    softcap,
    G: tl.constexpr,
    G_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DEC_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile * split + part, kv head): the part-th ``TOKENS`` rows of a tile; a part of a
    few rows (a decode token) runs with ``DEC_ROWS`` matrix rows instead of ``BLOCK_M``."""
    tile = tl.program_id(0) // split
    part = tl.program_id(0) % split
    kvh = tl.program_id(1)
    fields = tiles + tile * 5
    skip = part * TOKENS
    rows = tl.load(fields + 3) - skip
    if rows > 0:
        rows = tl.minimum(rows, TOKENS)
        table = tables + tl.load(fields).to(tl.int64) * table_width - tl.load(fields + 4)
        qrow = tl.load(fields + 1) + skip
        pos = tl.load(fields + 2) + skip
        if rows <= DEC_ROWS // G_P:  # a decode token (or a short part): a small matrix
            _attend_tile(
                q,
                out,
                cache,
                table,
                sinks,
                stride_qt,
                stride_qh,
                stride_ot,
                stride_oh,
                stride_row,
                stride_head,
                rows_per_block,
                block_size,
                window,
                scale,
                softcap,
                kvh,
                qrow,
                pos,
                rows,
                G,
                G_P,
                HEAD_DIM,
                D_P,
                DEC_ROWS,
                BLOCK_N,
                HAS_SOFTCAP,
                HAS_SINKS,
                PRECISION,
            )
        else:
            _attend_tile(
                q,
                out,
                cache,
                table,
                sinks,
                stride_qt,
                stride_qh,
                stride_ot,
                stride_oh,
                stride_row,
                stride_head,
                rows_per_block,
                block_size,
                window,
                scale,
                softcap,
                kvh,
                qrow,
                pos,
                rows,
                G,
                G_P,
                HEAD_DIM,
                D_P,
                BLOCK_M,
                BLOCK_N,
                HAS_SOFTCAP,
                HAS_SINKS,
                PRECISION,
            )


def _attend_tile(
    q,
    out,
    cache,
    table,
    sinks,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_row,
    stride_head,
    rows_per_block,
    block_size,
    window,
    scale,
    softcap,
    kvh,
    qrow,
    pos,
    rows,
    G: tl.constexpr,
    G_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``rows`` query tokens from batch row ``qrow`` (position ``pos``) x the G heads of KV head
    ``kvh``: matrix row m is token m // G_P, head kvh * G + m % G_P."""
    LOG2E: tl.constexpr = 1.4426950408889634
    m_idx = tl.arange(0, BLOCK_M)
    token = m_idx // G_P
    head = kvh * G + m_idx % G_P
    row_ok = (token < rows) & (m_idx % G_P < G)
    d = tl.arange(0, D_P)
    d_ok = d < HEAD_DIM
    q_ptrs = q + (qrow + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    query = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    query_pos = pos + token
    last = pos + rows - 1
    if HAS_SINKS:  # the sink starts the running max with weight exp(0) = 1 and no value
        m_i = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    for start in range(tl.maximum(pos - window + 1, 0), last + 1, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos <= last
        block = tl.load(table + key_pos // block_size, mask=key_ok, other=0).to(tl.int64)
        key_rows = block * rows_per_block + key_pos % block_size
        k_ptrs = cache + key_rows[:, None] * stride_row + kvh * stride_head + d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        keys = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        values = tl.load(k_ptrs + block_size * stride_row, mask=kv_mask, other=0.0)
        s = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * scale
        if HAS_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - window)
        s = tl.where(visible & key_ok[None, :], s * LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o_ptrs = out + (qrow + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
