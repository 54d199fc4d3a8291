"""Prefill math of the batched Mamba2 mixer: the causal conv and the exact chunked SSD scan of R
chunks at once, with their tokens packed back to back (no padding to the longest chunk).

Chunks are ordered longest first, so the chunks still running at any sub-chunk are a prefix of
that order. The scan loops over sub-chunks of ``SUB_CHUNK`` tokens (never over requests): sub-chunk
``k`` gathers the ``k``-th piece of every chunk that long, pads the pieces to one width with
``dt = 0`` (an identity step for the state), and runs the quadratic form inside the pieces and the
state carry between them for all of those chunks together.

``engine.model.kernels.triton_ssd`` computes the same scan in three Triton launches over
``PackedChunks.sub_chunks`` (opt-in); this torch scan stays the reference and the CPU path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.uploads import to_device, upload

SUB_CHUNK = 64


@dataclass(frozen=True)
class Piece:
    """Sub-chunk ``k`` of the ``active`` longest chunks: ``index[j, t]`` is the packed token of
    chunk ``j``'s ``t``-th token in it where ``valid[j, t]`` (elsewhere a token of the same chunk);
    ``target`` is ``index`` with the padding sent to the spare output row ``num_tokens``."""

    active: int
    width: int
    index: torch.Tensor  # [active * width] long
    valid: torch.Tensor  # [active, width] bool
    target: torch.Tensor  # [active * width] long


@dataclass(frozen=True)
class PackedChunks:
    """Where R chunks' tokens (longest chunk first) sit in the packed token order and in the
    conv input, which holds each chunk's previous conv window right before its tokens.

    Invariant: ``lengths`` is non-increasing; chunk ``j``'s tokens are packed tokens
    ``starts[j] .. starts[j] + lengths[j] - 1``.
    """

    lengths: list[int]
    starts: list[int]
    conv_width: int  # columns of the conv input
    conv_tokens: torch.Tensor  # [num_tokens] column of each packed token
    conv_windows: torch.Tensor  # [R * d_conv] columns of the previous windows, chunk-major
    conv_tails: torch.Tensor  # [R * d_conv] columns of the new windows, chunk-major
    #: the torch scan's sub-chunks (``ssd_scan_packed``); empty when not built (``pieces=False``)
    pieces: tuple[Piece, ...]
    #: int32 [S, 2]: (first packed token, tokens) of each sub-chunk, chunk-major, each chunk's
    #: cut at its own start every ``SUB_CHUNK`` tokens (the Triton scan's unit of work); None
    #: when not built (``table=False``)
    sub_chunks: torch.Tensor | None
    #: int32 [R, 2]: (first sub-chunk, sub-chunks) of each chunk; a view of the same memory
    chunk_spans: torch.Tensor | None


def pack_chunks(
    lengths: list[int], d_conv: int, device: torch.device, pieces: bool = True, table: bool = True
) -> PackedChunks:
    """The packed layout of chunks of ``lengths`` (non-increasing): with ``pieces`` the torch
    scan's sub-chunks, with ``table`` the Triton scan's sub-chunk table (a step builds the one its
    scan reads)."""
    if any(a < b for a, b in itertools.pairwise(lengths)):
        raise ValueError(f"lengths: expected longest first, got {lengths}")
    count = len(lengths)
    sizes = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(sizes, 0) - sizes
    segment = starts + d_conv * torch.arange(count)  # first conv column of each chunk
    window = torch.arange(d_conv)
    chunk_of_token = torch.repeat_interleave(torch.arange(count), sizes)
    conv_tokens = torch.arange(int(sizes.sum())) + d_conv * (chunk_of_token + 1)
    conv_windows = (segment[:, None] + window[None, :]).reshape(-1)
    conv_tails = (segment[:, None] + sizes[:, None] + window[None, :]).reshape(-1)
    built = []
    for lo in range(0, lengths[0] if pieces else 0, SUB_CHUNK):
        active = sum(n > lo for n in lengths)
        steps = lo + torch.arange(min(SUB_CHUNK, lengths[0] - lo))
        valid = steps[None, :] < sizes[:active, None]
        index = torch.where(valid, starts[:active, None] + steps[None, :], starts[:active, None])
        target = torch.where(valid, index, sum(lengths))
        built.append(Piece(active, len(steps), *(upload(t, device) for t in (index.view(-1), valid, target.view(-1)))))
    sub_chunks, chunk_spans = _sub_chunk_table(lengths, starts.tolist(), device) if table else (None, None)
    return PackedChunks(
        lengths=list(lengths),
        starts=starts.tolist(),
        conv_width=int(sum(lengths)) + d_conv * count,
        conv_tokens=upload(conv_tokens, device),
        conv_windows=upload(conv_windows, device),
        conv_tails=upload(conv_tails, device),
        pieces=tuple(built),
        sub_chunks=sub_chunks,
        chunk_spans=chunk_spans,
    )


def _sub_chunk_table(lengths: list[int], starts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``PackedChunks.sub_chunks`` and ``.chunk_spans``, two views of one int32 tensor copied to
    ``device`` once."""
    cuts = [
        (start + lo, min(SUB_CHUNK, n - lo))
        for n, start in zip(lengths, starts, strict=True)
        for lo in range(0, n, SUB_CHUNK)
    ]
    counts = [-(-n // SUB_CHUNK) for n in lengths]
    firsts = list(itertools.accumulate(counts, initial=0))[:-1]
    flat = [v for cut in cuts for v in cut] + [v for span in zip(firsts, counts, strict=True) for v in span]
    table = to_device(flat, device, torch.int32)
    return table[: 2 * len(cuts)].view(-1, 2), table[2 * len(cuts) :].view(-1, 2)


def causal_conv_packed(
    inputs: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedChunks
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of every chunk from its previous window.

    inputs: [num_tokens, C] (packed); windows: [R, C, k]; weight: [C, 1, k]. Returns the conv
    output [num_tokens, C] (contiguous, before the activation) and each chunk's new window
    [R, C, k].
    """
    count, channels, k = windows.shape
    extended = inputs.new_empty(channels, packed.conv_width)
    extended.index_copy_(1, packed.conv_windows, windows.permute(1, 0, 2).reshape(channels, count * k))
    extended.index_copy_(1, packed.conv_tokens, inputs.T)
    conv = F.conv1d(extended[None], weight, bias, groups=channels)[0]  # output j ends at column j + k - 1
    new_windows = extended.index_select(1, packed.conv_tails).view(channels, count, k).permute(1, 0, 2)
    return conv.index_select(1, packed.conv_tokens - (k - 1)).T.contiguous(), new_windows


def ssd_scan_packed(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    h: torch.Tensor | None,
    packed: PackedChunks,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan of the packed chunks, heads split into G groups of E sharing B and C.

    x: [num_tokens, G, E, P]; dt: [num_tokens, G, E]; a: [G, E] (negative); b, c: [num_tokens,
    G, N]; h: [R, G, E, P, N], the states before the chunks (updated in place), or None when
    they are all zero. Returns y: [num_tokens, G, E, P] (without the D skip) and the states after
    the chunks.
    """
    assert packed.pieces, "packed without the torch scan's sub-chunks (pack_chunks(pieces=False))"
    groups, heads, head_dim = x.shape[1:]
    y = x.new_empty(x.shape[0] + 1, *x.shape[1:])  # the last row takes the padding's outputs
    for piece in packed.pieces:
        act, width = piece.active, piece.width
        xs, bs, cs = (t.index_select(0, piece.index).view(act, width, *t.shape[1:]) for t in (x, b, c))
        dts = dt.index_select(0, piece.index).view(act, width, groups, heads) * piece.valid[:, :, None, None]
        # per (chunk, group, head) along the piece: [A, G, E, w]
        log_decay = torch.cumsum(dts * a, dim=1).permute(0, 2, 3, 1)  # from the piece's start
        steps = dts.permute(0, 2, 3, 1)
        b_t, c_t = bs.transpose(1, 2), cs.transpose(1, 2)  # [A, G, w, N]
        # within the piece: y_t = sum_{s <= t} (C_t . B_s) exp(L_t - L_s) dt_s x_s
        scores = log_decay[..., :, None] - log_decay[..., None, :]  # [A, G, E, t, s]
        future = torch.ones(width, width, dtype=torch.bool, device=x.device).triu(1)
        scores.masked_fill_(future, float("-inf")).exp_()
        scores.mul_(torch.matmul(c_t, b_t.transpose(-1, -2))[:, :, None]).mul_(steps[..., None, :])
        ys = torch.matmul(scores, xs.permute(0, 2, 3, 1, 4))  # [A, G, E, t, P]
        if h is not None:  # from the carried state: y_t += exp(L_t) C_t . h
            carried = torch.matmul(c_t, h[:act].view(act, groups, heads * head_dim, -1).transpose(-1, -2))
            carried = carried.view(act, groups, width, heads, head_dim).transpose(2, 3)
            ys += carried * log_decay.exp()[..., None]
        # state after the piece: exp(L_end) h + sum_s exp(L_end - L_s) dt_s x_s B_s^T
        last = log_decay[..., -1]  # [A, G, E]
        weights = torch.exp(last[..., None] - log_decay) * steps  # [A, G, E, s]
        driven = (xs.permute(0, 2, 3, 4, 1) * weights[..., None, :]).reshape(act, groups, heads * head_dim, width)
        update = torch.matmul(driven, b_t).view(act, groups, heads, head_dim, -1)
        if h is None:  # the first piece covers every chunk
            h = update
        else:
            h[:act] = torch.exp(last)[..., None, None] * h[:act] + update
        y.index_copy_(0, piece.target, ys.permute(0, 3, 1, 2, 4).reshape(act * width, groups, heads, head_dim))
    assert h is not None
    return y[:-1], h
