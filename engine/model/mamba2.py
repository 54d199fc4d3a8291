"""Mamba2 mixer with per-request state kept in state blocks (conv window + SSM state, fp32).

A chunk of ``n`` tokens starting at ``start`` reads the request's state after ``start`` tokens
(zero for a fresh request), runs the causal conv and the selective-state-space scan, and writes
the state after ``start + n`` tokens. The scan is exact (no approximation): within sub-chunks it
uses the quadratic (attention-like) form, and carries the state between sub-chunks.

One forward handles every chunk of the step at once, in two batched passes with no Python loop
over requests:

- decode (one-token chunks): gather conv windows and SSM states by block id, one conv step and
  one recurrence ``h = exp(dt*A) h + dt * B x; y = C h + D x`` for all of them, scatter the new
  states into the write blocks (the SSM state a tile of heads at a time, so it stays in cache);
- prefill (longer chunks): padded to the longest into ``[R, T, ...]``; padded steps get ``dt = 0``
  (identity for the SSM) and each chunk's new conv window is gathered at its own length, so the
  padding changes no state.

Every block is read before it is written, so a chunk whose read and write block coincide is
fine; two chunks never share a write block (the coordinator's guarantee). ``forward_per_request`` in
``engine.model.mamba2_reference`` is the loop this replaces (set ``per_request`` to use it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch import MambaArch
from engine.model.batch import ForwardBatch, GroupIndex
from engine.model.mamba2_reference import SUB_CHUNK, forward_per_request
from engine.model.recurrent import RecurrentMixer


class GatedRMSNorm(nn.Module):
    """RMS norm of ``x * silu(gate)`` over groups of channels (Mamba2's output norm)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        shape = h.shape
        h = h.view(*shape[:-1], -1, self.group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.view(shape).to(dtype)


def ssd_scan_batched(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan of R sequences at once, heads split into G groups of E sharing B and C.

    x: [R, T, G, E, P]; dt: [R, T, G, E] (0 on padded steps); a: [G, E] (negative);
    b, c: [R, T, G, N]; h: [R, G, E, P, N] (the states before the chunks).
    Returns y: [R, T, G, E, P] (without the D skip) and the final states [R, G, E, P, N].
    """
    ys = []
    for lo in range(0, x.shape[1], SUB_CHUNK):
        xs, dts = x[:, lo : lo + SUB_CHUNK], dt[:, lo : lo + SUB_CHUNK]
        bs, cs = b[:, lo : lo + SUB_CHUNK], c[:, lo : lo + SUB_CHUNK]
        n = xs.shape[1]
        s = torch.cumsum(dts * a, dim=1)  # [R, n, G, E] log-decay from the sub-chunk start
        seg = s[:, :, None] - s[:, None, :]  # [R, t, s, G, E]
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        decay = torch.exp(seg.masked_fill(future[None, :, :, None, None], float("-inf")))
        scores = torch.einsum("rtgn,rsgn->rtsg", cs, bs)[..., None] * decay * dts[:, None]
        y = torch.einsum("rtsge,rsgep->rtgep", scores, xs)
        y = y + torch.einsum("rtgn,rgepn->rtgep", cs, h) * torch.exp(s)[..., None]
        last = s[:, -1]  # [R, G, E]
        weights = torch.exp(last[:, None] - s) * dts  # [R, n, G, E]
        h = torch.exp(last)[..., None, None] * h + torch.einsum("rsge,rsgn,rsgep->rgepn", weights, bs, xs)
        ys.append(y)
    return torch.cat(ys, dim=1), h


@dataclass(frozen=True)
class _Prefill:
    """Padded layout of the step's multi-token chunks: chunk ``r``'s token ``t`` is flat row
    ``rows[r, t]`` where ``valid[r, t]`` (padding repeats the chunk's first row)."""

    rows: torch.Tensor  # [R, T] long
    valid: torch.Tensor  # [R, T] bool
    lengths: torch.Tensor  # [R] long


#: SSM-state bytes a decode step gathers per tile of heads (all decoding chunks at once): small
#: enough to stay in cache from the gather through the update to the scatter
DECODE_TILE_BYTES = 1 << 21

_Update = tuple[list[int], torch.Tensor, torch.Tensor]  # write blocks, conv windows, SSM states


def _prefill_layout(batch: ForwardBatch, device: torch.device) -> _Prefill:
    chunks = [batch.chunks[i] for i in batch.prefill_chunks]
    offsets = torch.tensor([c.offset for c in chunks], dtype=torch.long)
    lengths = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long)
    steps = torch.arange(int(lengths.max()))
    valid = steps[None, :] < lengths[:, None]
    rows = torch.where(valid, offsets[:, None] + steps[None, :], offsets[:, None])
    return _Prefill(rows.to(device), valid.to(device), lengths.to(device))


class Mamba2Mixer(RecurrentMixer):
    """A Mamba2 layer over state blocks. Parameter names follow Hugging Face's Bamba mixer
    (``in_proj``, ``conv1d``, ``A_log`` ...).

    Owns: the conv-window and SSM-state views of its group's state blocks (``bind_state``).
    Invariant: block ``b``'s first ``state_floats`` fp32 values are one request's state (conv
    window ``[conv_dim, d_conv]`` then SSM state ``[H, P, N]``); a forward reads each chunk's
    ``state_read`` state before any chunk's new state overwrites it.
    """

    def __init__(self, arch: MambaArch, hidden_size: int, group: int, eps: float):
        super().__init__()
        self.arch = arch
        self.group = group
        self.per_request = False  # True: the pre-batching loop (benchmark "before", tests' reference)
        conv_dim = arch.conv_dim
        self.in_proj = nn.Linear(hidden_size, arch.intermediate_size + conv_dim + arch.num_heads, bias=arch.proj_bias)
        self.out_proj = nn.Linear(arch.intermediate_size, hidden_size, bias=arch.proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, arch.d_conv, groups=conv_dim, bias=arch.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(arch.num_heads))
        self.A_log = nn.Parameter(torch.zeros(arch.num_heads))
        self.D = nn.Parameter(torch.ones(arch.num_heads))
        self.norm = GatedRMSNorm(arch.intermediate_size, arch.intermediate_size // arch.n_groups, eps)
        self.conv_state: torch.Tensor | None = None  # [num_blocks, conv_dim, d_conv] fp32 view
        self.ssm_state: torch.Tensor | None = None  # [num_blocks, H, P, N] fp32 view
        self._tile_buffer: torch.Tensor | None = None  # decode's gather buffer, reused (see _tile_view)

    @property
    def state_floats(self) -> int:
        return self.arch.state_floats

    def bind_state(self, states: torch.Tensor) -> None:
        m, blocks = self.arch, states.shape[0]
        conv = m.conv_dim * m.d_conv
        self.conv_state = states[:, :conv].view(blocks, m.conv_dim, m.d_conv)
        self.ssm_state = states[:, conv : m.state_floats].view(blocks, m.num_heads, m.head_dim, m.d_state)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.per_request:
            return forward_per_request(self, hidden, batch)
        arch = self.arch
        index: GroupIndex = batch.groups[self.group]
        gate, xbc, dt = self.in_proj(hidden).split([arch.intermediate_size, arch.conv_dim, arch.num_heads], dim=-1)
        out = torch.empty(hidden.shape[0], arch.intermediate_size, dtype=torch.float32, device=hidden.device)
        # Every read of a block happens before any write of it: prefill gathers its states first,
        # decode updates its states tile by tile in place, prefill scatters last.
        update = self._prefill(xbc, dt, out, batch, index) if batch.prefill_chunks else None
        if batch.decode_chunks:
            self._decode(xbc, dt, out, batch, index)
        if update is not None:
            self._scatter(*update)
        return self.out_proj(self.norm(out, gate).to(hidden.dtype))

    def _read_blocks(self, reads: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block ids to gather for ``reads`` (-1 mapped to block 0) and the mask of fresh chunks
        (those starting from zeros; None when there are none)."""
        source = torch.tensor([max(r, 0) for r in reads], dtype=torch.long, device=device)
        fresh = torch.tensor([r < 0 for r in reads], device=device) if min(reads) < 0 else None
        return source, fresh

    def _write_blocks(self, writes: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(writes, dtype=torch.long, device=device)

    def _gather(self, reads: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the conv windows and SSM states in blocks ``reads`` (zeros where -1)."""
        assert self.conv_state is not None and self.ssm_state is not None, "Mamba state not bound"
        source, fresh = self._read_blocks(reads, device)
        conv, ssm = self.conv_state.index_select(0, source), self.ssm_state.index_select(0, source)
        if fresh is not None:
            conv.masked_fill_(fresh[:, None, None], 0.0)
            ssm.masked_fill_(fresh[:, None, None, None], 0.0)
        return conv, ssm

    def _scatter(self, writes: list[int], conv: torch.Tensor, ssm: torch.Tensor) -> None:
        assert self.conv_state is not None and self.ssm_state is not None, "Mamba state not bound"
        target = self._write_blocks(writes, conv.device)
        self.conv_state.index_copy_(0, target, conv)
        self.ssm_state.index_copy_(0, target, ssm)

    def _tile_view(self, count: int, heads: int, device: torch.device) -> torch.Tensor:
        """``[count, heads, P, N]`` in a buffer kept between steps: a fresh allocation this size
        per tile costs page faults that dwarf the update itself on CPU."""
        m = self.arch
        size = count * heads * m.head_dim * m.d_state
        buffer = self._tile_buffer
        if buffer is None or buffer.numel() < size or buffer.device != device:
            buffer = self._tile_buffer = torch.empty(size, dtype=torch.float32, device=device)
        return buffer[:size].view(count, heads, m.head_dim, m.d_state)

    def _step_dt(self, dt: torch.Tensor) -> torch.Tensor:
        step = F.softplus(dt.float() + self.dt_bias.float())
        return step.clamp(self.arch.time_step_min, self.arch.time_step_max)

    def _split_conv(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., conv_dim] -> x [..., G, E, P], b [..., G, N], c [..., G, N]."""
        m = self.arch
        x, b, c = conv.split([m.intermediate_size, m.n_groups * m.d_state, m.n_groups * m.d_state], dim=-1)
        lead = conv.shape[:-1]
        heads_per_group = m.num_heads // m.n_groups
        x = x.reshape(*lead, m.n_groups, heads_per_group, m.head_dim)
        return x, b.reshape(*lead, m.n_groups, m.d_state), c.reshape(*lead, m.n_groups, m.d_state)

    def _decode(
        self, xbc: torch.Tensor, dt: torch.Tensor, out: torch.Tensor, batch: ForwardBatch, index: GroupIndex
    ) -> None:
        """One recurrence step for every one-token chunk of the step at once: fills their rows of
        ``out`` and writes their new states. The SSM states are updated a tile of heads at a time
        (all chunks together), so the gathered tile stays in cache through its update."""
        assert self.conv_state is not None and self.ssm_state is not None, "Mamba state not bound"
        m, order, device = self.arch, batch.decode_chunks, xbc.device
        count, heads_per_group = len(order), m.num_heads // m.n_groups
        rows = torch.tensor([batch.chunks[i].offset for i in order], dtype=torch.long, device=device)
        source, fresh = self._read_blocks([index.state_read[i] for i in order], device)
        target = self._write_blocks([index.state_write[i] for i in order], device)
        conv_prev = self.conv_state.index_select(0, source)
        if fresh is not None:
            conv_prev.masked_fill_(fresh[:, None, None], 0.0)
        window = torch.cat([conv_prev[:, :, 1:], xbc.index_select(0, rows).float()[:, :, None]], dim=2)
        conv = torch.einsum("bck,ck->bc", window, self.conv1d.weight.float()[:, 0, :])
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias.float()
        x, b, c = self._split_conv(F.silu(conv))  # x [B, G, E, P]; b, c [B, G, N]
        x = x.reshape(count, m.num_heads, m.head_dim)
        b, c = (t.repeat_interleave(heads_per_group, dim=1) for t in (b, c))  # [B, H, N]
        step = self._step_dt(dt.index_select(0, rows))  # [B, H]
        rate = torch.exp(step * -torch.exp(self.A_log.float()))
        drive = step[..., None] * x  # [B, H, P]
        y = torch.empty_like(x)
        tile = max(1, DECODE_TILE_BYTES // (count * m.head_dim * m.d_state * 4))
        for lo in range(0, m.num_heads, tile):
            heads = slice(lo, lo + tile)
            h = self._tile_view(count, min(tile, m.num_heads - lo), device)  # [B, tile, P, N]
            torch.index_select(self.ssm_state[:, heads], 0, source, out=h)
            if fresh is not None:
                h.masked_fill_(fresh[:, None, None, None], 0.0)
            h.mul_(rate[:, heads, None, None]).addcmul_(drive[:, heads, :, None], b[:, heads, None, :])
            y[:, heads] = torch.linalg.vecdot(h, c[:, heads, None, :])  # C h (faster than a batched matvec)
            self.ssm_state[:, heads].index_copy_(0, target, h)
        self.conv_state.index_copy_(0, target, window)
        y += x * self.D.float()[:, None]
        out.index_copy_(0, rows, y.view(count, -1))

    def _prefill(
        self, xbc: torch.Tensor, dt: torch.Tensor, out: torch.Tensor, batch: ForwardBatch, index: GroupIndex
    ) -> _Update:
        """The causal conv and SSD scan of every multi-token chunk, padded into ``[R, T, ...]``;
        fills their rows of ``out`` and returns their new states."""
        m = self.arch
        order = batch.prefill_chunks
        layout = _prefill_layout(batch, xbc.device)
        num, width = layout.rows.shape
        conv_prev, h0 = self._gather([index.state_read[i] for i in order], xbc.device)
        inputs = xbc.float()[layout.rows] * layout.valid[..., None]  # [R, T, conv_dim]
        window = torch.cat([conv_prev, inputs.transpose(1, 2)], dim=2)  # [R, conv_dim, k + T]
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        conv = F.conv1d(window, self.conv1d.weight.float(), bias, groups=m.conv_dim)[:, :, -width:]
        tail = layout.lengths[:, None] + torch.arange(m.d_conv, device=xbc.device)[None, :]  # [R, k]
        new_conv = window.gather(2, tail[:, None, :].expand(num, m.conv_dim, m.d_conv))
        x, b, c = self._split_conv(F.silu(conv).transpose(1, 2))  # x [R, T, G, E, P]; b, c [R, T, G, N]
        step = self._step_dt(dt[layout.rows]).view(x.shape[:4]) * layout.valid[:, :, None, None]
        a = -torch.exp(self.A_log.float()).view(x.shape[2:4])
        y, h = ssd_scan_batched(x, step, a, b, c, h0.view(num, *x.shape[2:], m.d_state))
        y = y + x * self.D.float().view(x.shape[2:4])[..., None]
        out.index_copy_(0, layout.rows[layout.valid], y[layout.valid].reshape(-1, m.intermediate_size))
        return [index.state_write[i] for i in order], new_conv, h.reshape(num, m.num_heads, m.head_dim, m.d_state)
