"""Prefill math of the batched Mamba2 mixer: the causal conv and the exact chunked SSD scan of R
chunks at once, with their tokens packed back to back (no padding to the longest chunk).

Chunks are ordered longest first, so the chunks still running at any sub-chunk are a prefix of
that order. The scan loops over sub-chunks of ``SUB_CHUNK`` tokens (never over requests): sub-chunk
``k`` gathers the ``k``-th piece of every chunk that long, pads the pieces to one width with
``dt = 0`` (an identity step for the state), and runs the quadratic form inside the pieces and the
state carry between them for all of those chunks together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUB_CHUNK = 64


@dataclass(frozen=True)
class Piece:
    """Sub-chunk ``k`` of the ``active`` longest chunks: ``index[j, t]`` is the packed token of
    chunk ``j``'s ``t``-th token in it where ``valid[j, t]`` (elsewhere a token of the same chunk)."""

    active: int
    index: torch.Tensor  # [active, width] long
    valid: torch.Tensor  # [active, width] bool


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
    pieces: tuple[Piece, ...]


def pack_chunks(lengths: list[int], d_conv: int, device: torch.device) -> PackedChunks:
    """The packed layout of chunks of ``lengths`` (non-increasing)."""
    if any(a < b for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"lengths: expected longest first, got {lengths}")
    count = len(lengths)
    sizes = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(sizes, 0) - sizes
    segment = starts + d_conv * torch.arange(count)  # first conv column of each chunk
    window = torch.arange(d_conv)
    conv_tokens = torch.cat([segment[j] + d_conv + torch.arange(n) for j, n in enumerate(lengths)])
    conv_windows = (segment[:, None] + window[None, :]).reshape(-1)
    conv_tails = (segment[:, None] + sizes[:, None] + window[None, :]).reshape(-1)
    pieces = []
    for lo in range(0, lengths[0], SUB_CHUNK):
        active = sum(n > lo for n in lengths)
        steps = lo + torch.arange(min(SUB_CHUNK, lengths[0] - lo))
        valid = steps[None, :] < sizes[:active, None]
        index = torch.where(valid, starts[:active, None] + steps[None, :], starts[:active, None])
        pieces.append(Piece(active, index.to(device), valid.to(device)))
    return PackedChunks(
        lengths=list(lengths),
        starts=starts.tolist(),
        conv_width=int(sum(lengths)) + d_conv * count,
        conv_tokens=conv_tokens.to(device),
        conv_windows=conv_windows.to(device),
        conv_tails=conv_tails.to(device),
        pieces=tuple(pieces),
    )


def causal_conv_packed(
    inputs: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedChunks
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of every chunk from its previous window.

    inputs: [num_tokens, C] (packed); windows: [R, C, k]; weight: [C, 1, k]. Returns the conv
    output [num_tokens, C] (before the activation) and each chunk's new window [R, C, k].
    """
    count, channels, k = windows.shape
    extended = inputs.new_empty(channels, packed.conv_width)
    extended[:, packed.conv_windows] = windows.permute(1, 0, 2).reshape(channels, count * k)
    extended[:, packed.conv_tokens] = inputs.T
    conv = F.conv1d(extended[None], weight, bias, groups=channels)[0]  # output j ends at column j + k - 1
    new_windows = extended[:, packed.conv_tails].view(channels, count, k).permute(1, 0, 2)
    return conv[:, packed.conv_tokens - (k - 1)].T, new_windows


def ssd_scan_packed(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    h: torch.Tensor,
    packed: PackedChunks,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan of the packed chunks, heads split into G groups of E sharing B and C.

    x: [num_tokens, G, E, P]; dt: [num_tokens, G, E]; a: [G, E] (negative); b, c: [num_tokens,
    G, N]; h: [R, G, E, P, N], the states before the chunks (updated in place to the states
    after them). Returns y: [num_tokens, G, E, P] (without the D skip) and ``h``.
    """
    y = torch.empty_like(x)
    for piece in packed.pieces:
        index, act = piece.index, piece.active
        xs, bs, cs = x[index], b[index], c[index]  # [A, w, G, E, P], [A, w, G, N]
        dts = dt[index] * piece.valid[:, :, None, None]  # [A, w, G, E]; padding: identity steps
        hs = h[:act]
        s = torch.cumsum(dts * a, dim=1)  # log-decay from the piece's start
        seg = s[:, :, None] - s[:, None, :]  # [A, t, s, G, E]
        future = torch.ones(s.shape[1], s.shape[1], dtype=torch.bool, device=x.device).triu(1)
        decay = torch.exp(seg.masked_fill(future[None, :, :, None, None], float("-inf")))
        scores = torch.einsum("atgn,asgn->atsg", cs, bs)[..., None] * decay * dts[:, None]
        ys = torch.einsum("atsge,asgep->atgep", scores, xs)
        ys = ys + torch.einsum("atgn,agepn->atgep", cs, hs) * torch.exp(s)[..., None]
        last = s[:, -1]  # [A, G, E]
        weights = torch.exp(last[:, None] - s) * dts
        h[:act] = torch.exp(last)[..., None, None] * hs + torch.einsum("asge,asgn,asgep->agepn", weights, bs, xs)
        y[index[piece.valid]] = ys[piece.valid]
    return y, h
