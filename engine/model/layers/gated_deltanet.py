"""Gated DeltaNet (Qwen3-Next's linear attention) with per-request state in state blocks.

Per token ``t`` (per value head; ``k``, ``q`` L2-normalised, ``q`` scaled by ``head_k_dim**-0.5``)::

    S_t = exp(g_t) * S_{t-1}                       # gated decay, g_t <= 0
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T # delta rule: write only the correction
    o_t = S_t^T q_t

``S`` is ``[head_k_dim, head_v_dim]``. One request's state is the last ``conv_kernel - 1`` inputs
of the causal conv plus ``S`` for every value head, fp32.

A chunk of ``n`` tokens starting at ``start`` reads the state after ``start`` tokens (zeros for a
fresh request) and writes the state after ``start + n``. Decode chunks (one token each) run as one
batched recurrent step. Prefill chunks are packed back to back and run together in the chunked
(WY) form: within a sub-chunk of ``SUB_CHUNK`` tokens the deltas solve one unit lower triangular
system (for all sub-chunks at once), and the state is carried between sub-chunks. A chunk's last
sub-chunk is padded with tokens of zero key, value, beta and log-decay, which leave its state
unchanged.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch.model_arch import GatedDeltaNetArch
from engine.model.batch import ForwardBatch, GroupIndex
from engine.model.layers import recurrent
from engine.model.layers.parallel import all_reduce
from engine.model.layers.recurrent import RecurrentMixer
from engine.model.uploads import to_device

SUB_CHUNK = 64
L2_EPS = 1e-6


class NormThenGate(nn.Module):
    """``weight * rms_norm(x) * silu(gate)`` over each value head (norm first, then the gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request. q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H]; state:
    [B, H, Dk, Dv]. Returns the output [B, H, Dv] and the new state."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def unit_lower_inverse(strict: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower triangular ``A`` [..., c, c]: ``A`` is nilpotent, so the
    inverse is ``sum_{k<c} (-A)^k = (I - A)(I + A^2)(I + A^4)...``, a few batched matmuls (a
    batched triangular solve runs one small LAPACK call per matrix, many times slower on CPU)."""
    c = strict.shape[-1]
    power = -strict
    inverse = torch.eye(c, dtype=strict.dtype, device=strict.device) + power
    covered = 2  # inverse holds the powers 0 .. covered - 1
    while covered < c:
        power = power @ power
        inverse = inverse + inverse @ power
        covered *= 2
    return inverse


def pack_sub_chunks(lengths: list[int], device: torch.device) -> tuple[list[int], torch.Tensor]:
    """Lay sequences of ``lengths`` (longest first) out as sub-chunks of ``SUB_CHUNK`` tokens in
    scan order: all sequences' first sub-chunks, then the second sub-chunks of those that have
    one, and so on, so step ``i`` of the scan reads one contiguous slice. Returns ``active[i]``
    (how many sequences have a sub-chunk ``i``) and, for the sequences' tokens back to back, each
    token's flat position in the packed ``[sum(active) * SUB_CHUNK]`` layout."""
    if any(a < b for a, b in pairwise(lengths)):
        raise ValueError(f"lengths must be sorted longest first, got {lengths}")
    counts = [-(-n // SUB_CHUNK) for n in lengths]
    active = [sum(1 for c in counts if c > i) for i in range(max(counts, default=0))]
    starts = to_device([0, *active], device).cumsum(0)[:-1]  # first slot of each step
    n = to_device(lengths, device)
    total = sum(lengths)  # from the host list: no read of the device's
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), n, output_size=total)
    first = torch.cumsum(n, 0) - n
    t = torch.arange(total, device=device) - first[seq]
    return active, (starts[t // SUB_CHUNK] + seq) * SUB_CHUNK + t % SUB_CHUNK


def delta_rule_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    active: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences packed as sub-chunks in scan order (see ``pack_sub_chunks``). q, k:
    [S, H, C, Dk]; v: [S, H, C, Dv]; g, beta: [S, H, C] (zeros past a sequence's end); state:
    [B, H, Dk, Dv], one per sequence, longest first. Returns [S, H, C, Dv] and the final states.

    Within a sub-chunk with cumulative log-decay ``c`` (``c_t = g_1 + ... + g_t``), the deltas
    ``d_t = beta_t (v_t - exp(c_t) S_0^T k_t - sum_{j<t} exp(c_t - c_j) (k_t . k_j) d_j)`` solve
    ``(I + A) d = beta v - beta exp(c) K S_0`` with ``A[t, j] = beta_t exp(c_t - c_j) k_t . k_j``
    (strictly lower); then ``o_t = exp(c_t) S_0^T q_t + sum_{j<=t} exp(c_t - c_j) (q_t . k_j) d_j``
    and ``S_C = exp(c_C) S_0 + sum_j exp(c_C - c_j) k_j d_j^T``. Everything but the carry of
    ``S_0`` from one sub-chunk to the next is computed for all sub-chunks at once.
    """
    c, dk = q.shape[-2], q.shape[-1]
    cum = g.cumsum(-1)  # [S, H, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., t, j]
    strict = (beta[..., None] * (k @ k.transpose(-1, -2)) * pair).tril(-1)  # A
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * cum.exp()[..., None] * k], dim=-1)
    d_free, d_state = (unit_lower_inverse(strict) @ rhs).split([v.shape[-1], dk], dim=-1)  # d = d_free - d_state S_0
    scores = (q @ k.transpose(-1, -2)) * pair  # zero above the diagonal
    q_decayed = q * cum.exp()[..., None]
    k_to_end = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    state = state.clone()
    lo = 0
    for n in active:
        sl, s0 = slice(lo, lo + n), state[:n]
        d = d_free[sl] - d_state[sl] @ s0
        out[sl] = q_decayed[sl] @ s0 + scores[sl] @ d
        state[:n] = s0 * chunk_decay[sl] + k_to_end[sl] @ d
        lo += n
    return out, state


class GatedDeltaNet(RecurrentMixer):
    """Owns one linear-attention layer's projections and the views of its state blocks.

    Parameter names follow Hugging Face's Qwen3-Next (``in_proj_qkvz``, ``in_proj_ba``,
    ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``). Invariant: block ``b``'s first
    ``arch.state_floats`` values are ``conv_state[b]`` then ``recurrent_state[b]``. ``reduce``:
    ``arch`` is one tensor-parallel rank's heads (engine/model/layers/parallel.py), so ``out_proj``'s
    output is summed over the ranks.
    """

    def __init__(self, arch: GatedDeltaNetArch, hidden_size: int, group: int, eps: float, reduce: bool = False):
        super().__init__()
        self.arch = arch
        self.reduce = reduce
        self.group = group
        per_k = 2 * arch.head_k_dim + 2 * arch.head_v_dim * (arch.num_v_heads // arch.num_k_heads)
        self.in_proj_qkvz = nn.Linear(hidden_size, arch.num_k_heads * per_k, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * arch.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(arch.conv_dim, arch.conv_dim, arch.conv_kernel, groups=arch.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(arch.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(arch.num_v_heads))
        self.norm = NormThenGate(arch.head_v_dim, eps)
        self.out_proj = nn.Linear(arch.value_dim, hidden_size, bias=False)
        self.conv_state: torch.Tensor | None = None  # [num_blocks, conv_dim, conv_kernel - 1] fp32 view
        self.recurrent_state: torch.Tensor | None = None  # [num_blocks, Hv, Dk, Dv] fp32 view

    @property
    def state_floats(self) -> int:
        return self.arch.state_floats

    def bind_state(self, states: torch.Tensor) -> None:
        a, blocks = self.arch, states.shape[0]
        conv = a.conv_dim * (a.conv_kernel - 1)
        self.conv_state = states[:, :conv].view(blocks, a.conv_dim, a.conv_kernel - 1)
        self.recurrent_state = states[:, conv : a.state_floats].view(blocks, a.num_v_heads, a.head_k_dim, a.head_v_dim)

    def _split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project: the conv input (q, k, v channels) [T, conv_dim], the output gate z
        [T, Hv, Dv], and b, a [T, Hv]. Projections are grouped per key head in the checkpoint."""
        a = self.arch
        t, per_group = hidden.shape[0], a.num_v_heads // a.num_k_heads
        qkvz = self.in_proj_qkvz(hidden).view(t, a.num_k_heads, -1)
        q, k, v, z = qkvz.split([a.head_k_dim, a.head_k_dim, per_group * a.head_v_dim, per_group * a.head_v_dim], -1)
        b, alpha = self.in_proj_ba(hidden).view(t, a.num_k_heads, 2 * per_group).split([per_group, per_group], -1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, a.num_v_heads, a.head_v_dim), b.reshape(t, -1), alpha.reshape(t, -1)

    def _read_states(self, reads: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.conv_state is not None and self.recurrent_state is not None, "Gated DeltaNet state not bound"
        ids = to_device([max(r, 0) for r in reads], device, torch.long)
        fresh = to_device([r < 0 for r in reads], device, torch.bool)
        conv = self.conv_state.index_select(0, ids).masked_fill(fresh[:, None, None], 0.0)
        rec = self.recurrent_state.index_select(0, ids).masked_fill(fresh[:, None, None, None], 0.0)
        return conv, rec

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        a = self.arch
        index: GroupIndex = batch.groups[self.group]
        mixed, z, b, alpha = self._split(hidden)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())  # [T, Hv]
        beta = b.float().sigmoid()
        core = torch.empty(hidden.shape[0], a.num_v_heads, a.head_v_dim, dtype=torch.float32, device=hidden.device)
        if batch.decode_chunks:
            self._decode(batch.decode_chunks, batch, index, mixed, g, beta, core)
        if batch.prefill_chunks:
            self._prefill(batch.prefill_chunks, batch, index, mixed, g, beta, core)
        out = self.norm(core.to(hidden.dtype), z)
        out = self.out_proj(out.reshape(hidden.shape[0], -1))
        return all_reduce(out) if self.reduce else out

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs [N, conv_dim] -> L2-normalised, scaled q and k [N, Hv, Dk] (key heads
        repeated for their value heads) and v [N, Hv, Dv]."""
        a, n = self.arch, conv.shape[0]
        q, k, v = conv.split([a.key_dim, a.key_dim, a.value_dim], dim=-1)
        per_group = a.num_v_heads // a.num_k_heads
        q = _l2norm(q.reshape(n, a.num_k_heads, a.head_k_dim)).repeat_interleave(per_group, dim=1)
        k = _l2norm(k.reshape(n, a.num_k_heads, a.head_k_dim)).repeat_interleave(per_group, dim=1)
        return q * a.head_k_dim**-0.5, k, v.reshape(n, a.num_v_heads, a.head_v_dim)

    def _write_states(self, chunk_ids: list[int], index: GroupIndex, conv: torch.Tensor, state: torch.Tensor) -> None:
        assert self.conv_state is not None and self.recurrent_state is not None
        writes = torch.tensor([index.state_write[i] for i in chunk_ids], dtype=torch.long, device=conv.device)
        self.conv_state.index_copy_(0, writes, conv)
        self.recurrent_state.index_copy_(0, writes, state)

    def _decode(
        self,
        chunk_ids: list[int],
        batch: ForwardBatch,
        index: GroupIndex,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        core: torch.Tensor,
    ) -> None:
        """One token per chunk: one batched conv step and one batched delta-rule step."""
        assert self.conv_state is not None and self.recurrent_state is not None, "Gated DeltaNet state not bound"
        rows, source, fresh, target = recurrent.decode_index(batch, index, mixed.device)
        conv_prev = self.conv_state.index_select(0, source)
        state = self.recurrent_state.index_select(0, source)
        if fresh is not None:
            conv_prev.masked_fill_(fresh[:, None, None], 0.0)
            state.masked_fill_(fresh[:, None, None, None], 0.0)
        window = torch.cat([conv_prev, mixed.float()[rows][:, :, None]], dim=2)  # [B, conv_dim, k]
        conv = F.silu((window * self.conv1d.weight.float()[:, 0, :]).sum(-1))  # [B, conv_dim]
        q, k, v = self._heads(conv)
        core[rows], state = delta_rule_step(q, k, v, g[rows], beta[rows], state)
        self.conv_state.index_copy_(0, target, window[:, :, 1:])
        self.recurrent_state.index_copy_(0, target, state)

    def _prefill(
        self,
        chunk_ids: list[int],
        batch: ForwardBatch,
        index: GroupIndex,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        core: torch.Tensor,
    ) -> None:
        """Chunks packed back to back (longest first; no padding beyond one sub-chunk each): one
        causal conv over all of them, each preceded by its previous window, then the packed
        chunked delta rule."""
        a, device, keep = self.arch, mixed.device, self.arch.conv_kernel - 1
        chunk_ids = sorted(chunk_ids, key=lambda i: -batch.chunks[i].num_tokens)
        chunks = [batch.chunks[i] for i in chunk_ids]
        conv_prev, state = self._read_states([index.state_read[i] for i in chunk_ids], device)
        rows = torch.cat([torch.arange(c.offset, c.offset + c.num_tokens, device=device) for c in chunks])
        x = mixed.float()
        pieces = [t for j, c in enumerate(chunks) for t in (conv_prev[j], x[c.offset : c.offset + c.num_tokens].T)]
        stream = torch.cat(pieces, dim=1)  # [conv_dim, sum(k - 1 + n)]
        conv = F.conv1d(stream[None], self.conv1d.weight.float(), groups=a.conv_dim)[0]  # [conv_dim, len - k + 1]
        lengths = to_device([c.num_tokens for c in chunks], device)
        segment = torch.cumsum(lengths + keep, 0) - (lengths + keep)  # where each chunk's window starts
        seq = torch.repeat_interleave(torch.arange(len(chunks), device=device), lengths)
        token = segment[seq] + torch.arange(rows.numel(), device=device) - (torch.cumsum(lengths, 0) - lengths)[seq]
        q, k, v = self._heads(F.silu(conv[:, token].T))  # [N, Hv, D]
        tails = segment[:, None] + lengths[:, None] + torch.arange(keep, device=device)[None, :]
        new_conv = stream[:, tails].permute(1, 0, 2)  # [B, conv_dim, k - 1]: the last k - 1 inputs

        active, dest = pack_sub_chunks([c.num_tokens for c in chunks], device)
        slots = sum(active) * SUB_CHUNK

        def packed(t: torch.Tensor) -> torch.Tensor:  # [N, H, ...] -> [S, H, C, ...] in scan order
            out = t.new_zeros(slots, *t.shape[1:]).index_copy_(0, dest, t)
            return out.view(-1, SUB_CHUNK, *t.shape[1:]).transpose(1, 2)

        out, state = delta_rule_packed(
            packed(q), packed(k), packed(v), packed(g[rows]), packed(beta[rows]), state, active
        )
        core[rows] = out.transpose(1, 2).reshape(slots, a.num_v_heads, a.head_v_dim)[dest]
        self._write_states(chunk_ids, index, new_conv, state)
