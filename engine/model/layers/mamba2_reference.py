"""The per-request Mamba2 forward (one Python iteration per chunk): the "before" of the batched
path in ``engine.model.layers.mamba2`` and the reference its tests compare against.

Kept as it was before batching: each chunk reads its state (zeros when ``state_read`` is -1),
runs the causal conv and the exact sub-chunked SSD scan on its own, and writes its state. Never
on the serving path: ``Mamba2Mixer.forward`` is always the batched one; callers that want this
loop (tests, the "before" of a benchmark) call ``forward_per_request(mixer, hidden, batch)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.model.batch import ForwardBatch, GroupIndex

if TYPE_CHECKING:
    from engine.model.layers.mamba2 import Mamba2Mixer

SUB_CHUNK = 64


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan of one sequence. x: [n, H, P]; dt: [n, H]; a: [H] (negative); b, c: [n, H, N];
    h0: [H, P, N]. Returns y: [n, H, P] (without the D skip) and the final state [H, P, N]."""
    ys = []
    h = h0
    for lo in range(0, x.shape[0], SUB_CHUNK):
        part = slice(lo, lo + SUB_CHUNK)
        xs, dts, bs, cs = x[part], dt[part], b[part], c[part]
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


def forward_per_request(mixer: Mamba2Mixer, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """``mixer``'s forward with a Python loop over the batch's chunks (also for decode steps)."""
    arch = mixer.arch
    index: GroupIndex = batch.groups[mixer.group]
    projected = mixer.in_proj(hidden)
    gate, xbc, dt = projected.split([arch.intermediate_size, arch.conv_dim, arch.num_heads], dim=-1)
    a = -torch.exp(mixer.A_log.float())
    weight = mixer.conv1d.weight  # [conv_dim, 1, k]
    out = torch.empty(hidden.shape[0], arch.intermediate_size, dtype=torch.float32, device=hidden.device)
    conv_state, ssm_state = mixer.conv_state, mixer.ssm_state
    assert conv_state is not None and ssm_state is not None, "Mamba state not bound"
    for i, chunk in enumerate(batch.chunks):
        rows = slice(chunk.offset, chunk.offset + chunk.num_tokens)
        read, write = index.state_read[i], index.state_write[i]
        if read >= 0:
            conv_prev = conv_state[read]
            h0 = ssm_state[read]
        else:
            conv_prev = torch.zeros(arch.conv_dim, arch.d_conv, dtype=torch.float32, device=hidden.device)
            h0 = torch.zeros(arch.num_heads, arch.head_dim, arch.d_state, dtype=torch.float32, device=hidden.device)
        window = torch.cat([conv_prev, xbc[rows].float().T], dim=1)  # [conv_dim, k + n]
        bias = None if mixer.conv1d.bias is None else mixer.conv1d.bias.float()
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
        step = F.softplus(dt[rows].float() + mixer.dt_bias.float())
        step = step.clamp(arch.time_step_min, arch.time_step_max)
        y, h = ssd_scan(x, step, a, b, c, h0)
        y = y + x * mixer.D.float()[None, :, None]
        out[rows] = y.reshape(n, -1)
        conv_state[write] = window[:, -arch.d_conv :]
        ssm_state[write] = h
    return mixer.out_proj(mixer.norm(out, gate).to(hidden.dtype))
