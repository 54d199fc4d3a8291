"""Gated DeltaNet (Qwen3-Next's linear attention) with per-request state in state blocks.

Per token ``t`` (per value head; ``k``, ``q`` L2-normalised, ``q`` scaled by ``head_k_dim**-0.5``)::

    S_t = exp(g_t) * S_{t-1}                       # gated decay, g_t <= 0
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T # delta rule: write only the correction
    o_t = S_t^T q_t

``S`` is ``[head_k_dim, head_v_dim]``. One request's state is the last ``conv_kernel - 1`` inputs
of the causal conv plus ``S`` for every value head, fp32.

A chunk of ``n`` tokens starting at ``start`` reads the state after ``start`` tokens (zeros for a
fresh request) and writes the state after ``start + n``. Decode chunks (one token each) run as one
batched recurrent step. Prefill chunks are padded to a common length and run together in the
chunked (WY) form: within a sub-chunk of ``SUB_CHUNK`` tokens the deltas solve one unit lower
triangular system, and the state is carried between sub-chunks. Padding tokens have zero key,
value and beta and zero log-decay, so they leave the state unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch import GatedDeltaNetArch
from engine.model.batch import ForwardBatch, GroupIndex
from engine.model.recurrent import RecurrentMixer

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


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences. q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; g, beta: [B, H, L] with ``L`` a
    multiple of ``SUB_CHUNK``; state: [B, H, Dk, Dv]. Returns [B, H, L, Dv] and the final state.

    Within a sub-chunk with cumulative log-decay ``c`` (``c_t = g_1 + ... + g_t``), the deltas
    ``d_t = beta_t (v_t - exp(c_t) S_0^T k_t - sum_{j<t} exp(c_t - c_j) (k_t . k_j) d_j)`` solve
    ``(I + A) d = beta v - beta exp(c) K S_0`` with ``A[t, j] = beta_t exp(c_t - c_j) k_t . k_j``
    (strictly lower); then ``o_t = exp(c_t) S_0^T q_t + sum_{j<=t} exp(c_t - c_j) (q_t . k_j) d_j``
    and ``S_C = exp(c_C) S_0 + sum_j exp(c_C - c_j) k_j d_j^T``.
    """
    b, h, length, dk = k.shape
    c = SUB_CHUNK
    n = length // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    cum = g.cumsum(-1)  # [b, h, n, c]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., t, j]
    kk = k @ k.transpose(-1, -2)
    strict = (beta[..., None] * kk * pair).tril(-1)  # A
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * cum.exp()[..., None] * k], dim=-1)
    solved = unit_lower_inverse(strict) @ rhs
    d_free, d_state = solved.split([v.shape[-1], dk], dim=-1)  # d = d_free - d_state @ S_0
    scores = (q @ k.transpose(-1, -2)) * pair  # [.., t, j], zero above the diagonal
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [b, h, n, 1, 1]
    out = torch.empty_like(v)
    for i in range(n):
        d = d_free[:, :, i] - d_state[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ d
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ d
    return out.reshape(b, h, length, -1), state


class GatedDeltaNet(RecurrentMixer):
    """Owns one linear-attention layer's projections and the views of its state blocks.

    Parameter names follow Hugging Face's Qwen3-Next (``in_proj_qkvz``, ``in_proj_ba``,
    ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``). Invariant: block ``b``'s first
    ``arch.state_floats`` values are ``conv_state[b]`` then ``recurrent_state[b]``.
    """

    def __init__(self, arch: GatedDeltaNetArch, hidden_size: int, group: int, eps: float):
        super().__init__()
        self.arch = arch
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
        ids = torch.tensor([max(r, 0) for r in reads], dtype=torch.long, device=device)
        fresh = torch.tensor([r < 0 for r in reads], dtype=torch.bool, device=device)
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
        for chunks in (batch.decode_chunks, batch.prefill_chunks):
            if chunks:
                self._run_chunks(chunks, batch, index, mixed, g, beta, core)
        out = self.norm(core.to(hidden.dtype), z)
        return self.out_proj(out.reshape(hidden.shape[0], -1))

    def _run_chunks(
        self,
        chunk_ids: list[int],
        batch: ForwardBatch,
        index: GroupIndex,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        core: torch.Tensor,
    ) -> None:
        """Run the given chunks together (padded to their longest), writing their outputs into
        ``core`` and their final states into their write blocks."""
        a, device = self.arch, mixed.device
        chunks = [batch.chunks[i] for i in chunk_ids]
        lengths = torch.tensor([c.num_tokens for c in chunks], device=device)
        width = max(c.num_tokens for c in chunks)
        steps = torch.arange(width, device=device)
        valid = steps[None, :] < lengths[:, None]  # [B, L]
        rows = torch.tensor([c.offset for c in chunks], device=device)[:, None] + steps[None, :]
        rows = torch.where(valid, rows, 0)
        conv_prev, state = self._read_states([index.state_read[i] for i in chunk_ids], device)

        # Causal depthwise conv over [previous inputs | this chunk's inputs], batched.
        x = mixed.float()[rows].masked_fill(~valid[..., None], 0.0).transpose(1, 2)  # [B, conv_dim, L]
        window = torch.cat([conv_prev, x], dim=2)  # [B, conv_dim, k - 1 + L]
        conv = F.silu(F.conv1d(window, self.conv1d.weight.float(), groups=a.conv_dim)).transpose(1, 2)  # [B, L, C]
        keep = a.conv_kernel - 1  # the last k - 1 real inputs: window columns [n, n + k - 1)
        tail = lengths[:, None] + torch.arange(keep, device=device)[None, :]
        new_conv = window.gather(2, tail[:, None, :].expand(-1, a.conv_dim, -1))

        q, k, v = conv.split([a.key_dim, a.key_dim, a.value_dim], dim=-1)
        per_group = a.num_v_heads // a.num_k_heads
        bsz = len(chunks)
        q = _l2norm(q.reshape(bsz, width, a.num_k_heads, a.head_k_dim)).repeat_interleave(per_group, dim=2)
        k = _l2norm(k.reshape(bsz, width, a.num_k_heads, a.head_k_dim)).repeat_interleave(per_group, dim=2)
        q = q * a.head_k_dim**-0.5
        v = v.reshape(bsz, width, a.num_v_heads, a.head_v_dim)
        gs = g[rows].masked_fill(~valid[..., None], 0.0)  # [B, L, Hv]
        betas = beta[rows].masked_fill(~valid[..., None], 0.0)
        if width == 1:
            out, state = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], gs[:, 0], betas[:, 0], state)
            out = out[:, None]  # [B, 1, Hv, Dv]
        else:
            pad = -width % SUB_CHUNK
            q, k, v = (F.pad(t.transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))  # [B, H, L', D]
            gs, betas = (F.pad(t.transpose(1, 2), (0, pad)) for t in (gs, betas))  # [B, H, L']
            out, state = delta_rule_chunked(q, k, v, gs, betas, state)
            out = out[:, :, :width].transpose(1, 2)  # [B, L, Hv, Dv]
        core[rows[valid]] = out[valid]
        writes = torch.tensor([index.state_write[i] for i in chunk_ids], dtype=torch.long, device=device)
        assert self.conv_state is not None and self.recurrent_state is not None
        self.conv_state.index_copy_(0, writes, new_conv)
        self.recurrent_state.index_copy_(0, writes, state)
