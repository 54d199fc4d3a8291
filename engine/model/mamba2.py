"""Mamba2 mixer with per-request state kept in state blocks (conv window + SSM state, fp32).

A chunk of ``n`` tokens starting at ``start`` reads the request's state after ``start`` tokens
(zero for a fresh request), runs the causal conv and the selective-state-space scan, and writes
the state after ``start + n`` tokens. The scan is exact (no approximation): within sub-chunks it
uses the quadratic (attention-like) form, and carries the state between sub-chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch import MambaArch
from engine.model.batch import ForwardBatch, GroupIndex
from engine.model.recurrent import RecurrentMixer

SUB_CHUNK = 64


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


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan of one sequence. x: [n, H, P]; dt: [n, H]; a: [H] (negative); b, c: [n, H, N];
    h0: [H, P, N]. Returns y: [n, H, P] (without the D skip) and the final state [H, P, N]."""
    ys = []
    h = h0
    for lo in range(0, x.shape[0], SUB_CHUNK):
        xs, dts, bs, cs = x[lo : lo + SUB_CHUNK], dt[lo : lo + SUB_CHUNK], b[lo : lo + SUB_CHUNK], c[lo : lo + SUB_CHUNK]
        n = xs.shape[0]
        s = torch.cumsum(dts * a[None, :], dim=0)  # [n, H] log-decay from the sub-chunk start
        seg = s[:, None, :] - s[None, :, :]  # [t, s, H]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(seg.masked_fill(~causal[:, :, None], float("-inf")))
        scores = torch.einsum("thn,shn->tsh", cs, bs) * decay * dts[None, :, :]
        y = torch.einsum("tsh,shp->thp", scores, xs)
        y = y + torch.einsum("thn,hpn->thp", cs, h) * torch.exp(s)[:, :, None]
        last = s[-1]
        weights = torch.exp(last[None, :] - s) * dts  # [n, H]
        h = torch.exp(last)[:, None, None] * h + torch.einsum("sh,shn,shp->hpn", weights, bs, xs)
        ys.append(y)
    return torch.cat(ys), h


class Mamba2Mixer(RecurrentMixer):
    """Parameter names follow Hugging Face's Bamba mixer (``in_proj``, ``conv1d``, ``A_log`` ...)."""

    def __init__(self, arch: MambaArch, hidden_size: int, group: int, eps: float):
        super().__init__()
        self.arch = arch
        self.group = group
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

    @property
    def state_floats(self) -> int:
        return self.arch.state_floats

    def bind_state(self, states: torch.Tensor) -> None:
        m, blocks = self.arch, states.shape[0]
        conv = m.conv_dim * m.d_conv
        self.conv_state = states[:, :conv].view(blocks, m.conv_dim, m.d_conv)
        self.ssm_state = states[:, conv : m.state_floats].view(blocks, m.num_heads, m.head_dim, m.d_state)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        arch = self.arch
        index: GroupIndex = batch.groups[self.group]
        projected = self.in_proj(hidden)
        gate, xbc, dt = projected.split([arch.intermediate_size, arch.conv_dim, arch.num_heads], dim=-1)
        a = -torch.exp(self.A_log.float())
        weight = self.conv1d.weight  # [conv_dim, 1, k]
        out = torch.empty(hidden.shape[0], arch.intermediate_size, dtype=torch.float32, device=hidden.device)
        assert self.conv_state is not None and self.ssm_state is not None, "Mamba state not bound"
        for i, chunk in enumerate(batch.chunks):
            rows = slice(chunk.offset, chunk.offset + chunk.num_tokens)
            read, write = index.state_read[i], index.state_write[i]
            if read >= 0:
                conv_prev = self.conv_state[read]
                h0 = self.ssm_state[read]
            else:
                conv_prev = torch.zeros(arch.conv_dim, arch.d_conv, dtype=torch.float32, device=hidden.device)
                h0 = torch.zeros(arch.num_heads, arch.head_dim, arch.d_state, dtype=torch.float32, device=hidden.device)
            window = torch.cat([conv_prev, xbc[rows].float().T], dim=1)  # [conv_dim, k + n]
            bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
            conv = F.conv1d(window[None], weight.float(), bias, groups=arch.conv_dim)[0, :, -chunk.num_tokens :]
            conv = F.silu(conv).T  # [n, conv_dim]
            x, b, c = conv.split(
                [arch.intermediate_size, arch.n_groups * arch.d_state, arch.n_groups * arch.d_state], dim=-1
            )
            n = chunk.num_tokens
            heads_per_group = arch.num_heads // arch.n_groups
            x = x.reshape(n, arch.num_heads, arch.head_dim)
            b = b.reshape(n, arch.n_groups, arch.d_state).repeat_interleave(heads_per_group, dim=1)
            c = c.reshape(n, arch.n_groups, arch.d_state).repeat_interleave(heads_per_group, dim=1)
            step = F.softplus(dt[rows].float() + self.dt_bias.float())
            step = step.clamp(arch.time_step_min, arch.time_step_max)
            y, h = ssd_scan(x, step, a, b, c, h0)
            y = y + x * self.D.float()[None, :, None]
            out[rows] = y.reshape(n, -1)
            self.conv_state[write] = window[:, -arch.d_conv :]
            self.ssm_state[write] = h
        return self.out_proj(self.norm(out, gate).to(hidden.dtype))
