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
  on CUDA (``KVFLEET_MAMBA_KERNEL`` unset or ``triton``) two kernels do all of it
  (``engine.model.kernels.triton_mamba``);
- prefill (longer chunks): tokens packed back to back, one causal conv over all chunks (each
  preceded by its previous window) and the sub-chunked SSD scan over all chunks at once
  (``engine.model.layers.ssd``); padding inside a sub-chunk gets ``dt = 0``, an identity step, so it
  changes no state. ``KVFLEET_SSD_KERNEL=triton`` runs that scan as three Triton kernels instead
  (``engine.model.kernels.triton_ssd``; opt-in until a GPU run has checked it compiled).

Every block is read before it is written, so a chunk whose read and write block coincide is
fine; two chunks never share a write block (the coordinator's guarantee).
``forward_per_request`` in ``engine.model.layers.mamba2_reference`` is the per-chunk loop this replaces;
tests compare the two, the serving path never calls it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.model.arch.model_arch import MambaArch
from engine.model.batch import ForwardBatch, GroupIndex
from engine.model.kernels import triton_mamba, triton_norm, triton_ssd
from engine.model.layers import recurrent
from engine.model.layers.parallel import all_reduce
from engine.model.layers.recurrent import RecurrentMixer
from engine.model.layers.ssd import causal_conv_packed, pack_chunks, ssd_scan_packed
from engine.model.uploads import upload


class GatedRMSNorm(nn.Module):
    """RMS norm of ``x * silu(gate)`` over groups of channels (Mamba2's output norm).

    ``group_ranks`` > 1: this tensor-parallel rank holds 1/``group_ranks`` of one group's channels
    (group ``group`` of the model's; engine/model/layers/parallel.py), so the group's sum of squares
    is summed over the ranks that share it."""

    def __init__(self, dim: int, group_size: int, eps: float, group_ranks: int = 1, group: int = 0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps
        self.group_ranks, self.group = group_ranks, group
        self._kernel: bool | None = None  # triton_norm.enabled for the weight's device, read at first use

    def forward(self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The normed ``x * silu(gate)`` in ``out_dtype`` (None: the product's dtype); where
        ``triton_norm.enabled`` and the groups are whole on this rank, one kernel."""
        if self._kernel is None:
            self._kernel = triton_norm.enabled(self.weight.device)
        if self._kernel and self.group_ranks == 1:
            dtype = out_dtype or torch.promote_types(x.dtype, self.weight.dtype)
            return triton_norm.gated_rms_norm(x, gate, self.weight, self.group_size, self.eps, dtype)
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        shape = h.shape
        h = h.view(*shape[:-1], -1, self.group_size)
        if self.group_ranks > 1:  # one slot per group of the model: each rank adds its part to its group's
            squares = h.pow(2).sum(-1)  # [..., 1]
            slots = torch.zeros(*shape[:-1], dist.get_world_size() // self.group_ranks, device=h.device)
            slots[..., self.group] = squares[..., 0]
            total = all_reduce(slots)[..., self.group : self.group + 1]
            mean = (total / (self.group_size * self.group_ranks))[..., None]
        else:
            mean = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(mean + self.eps)
        out = self.weight * h.view(shape).to(dtype)
        return out if out_dtype is None else out.to(out_dtype)


#: On CPU, SSM-state bytes a decode step gathers per tile of heads (all decoding chunks at once):
#: about one core's L2, so a tile stays in cache from the gather through the update to the scatter
#: (other devices update all heads in one tile)
DECODE_TILE_BYTES = 1 << 20

_Update = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # write blocks, conv windows, SSM states


def prefill_index(batch: ForwardBatch, index: GroupIndex, d_conv: int, device: torch.device) -> tuple:
    """The prefill chunks (longest first), their packing, the flat row of each packed token, the
    state blocks to read (None when every chunk is fresh) with the fresh mask, and the blocks to
    write; built once per step per group like ``decode_index``."""

    def build() -> tuple:
        order = sorted(batch.prefill_chunks, key=lambda i: -batch.chunks[i].num_tokens)
        kernel = triton_ssd.enabled(device)  # the scan this step runs: its layout only
        packed = pack_chunks([batch.chunks[i].num_tokens for i in order], d_conv, device, not kernel, kernel)
        rows = torch.tensor([batch.chunks[i].offset for i in order]) - torch.tensor(packed.starts)
        rows = torch.repeat_interleave(rows, torch.tensor(packed.lengths)) + torch.arange(sum(packed.lengths))
        reads = [index.state_read[i] for i in order]
        source, fresh = (None, None) if max(reads) < 0 else recurrent.read_blocks(reads, device)
        target = recurrent.write_blocks([index.state_write[i] for i in order], device)
        return order, packed, upload(rows, device), source, fresh, target

    return index.shared(f"mamba2_prefill_{d_conv}", build)


class Mamba2Mixer(RecurrentMixer):
    """A Mamba2 layer over state blocks. Parameter names follow Hugging Face's Bamba mixer
    (``in_proj``, ``conv1d``, ``A_log`` ...).

    ``reduce``: ``arch`` is one tensor-parallel rank's heads (engine/model/layers/parallel.py), so
    ``out_proj``'s output is summed over the ranks.

    Owns: the conv-window and SSM-state views of its group's state blocks (``bind_state``).
    Invariant: block ``b``'s first ``state_floats`` fp32 values are one request's state (conv
    window ``[conv_dim, d_conv]`` then SSM state ``[H, P, N]``); a forward reads each chunk's
    ``state_read`` state before any chunk's new state overwrites it.
    """

    def __init__(self, arch: MambaArch, hidden_size: int, group: int, eps: float, reduce: bool = False):
        super().__init__()
        self.arch = arch
        self.reduce = reduce
        self.group = group
        conv_dim = arch.conv_dim
        self.in_proj = nn.Linear(hidden_size, arch.intermediate_size + conv_dim + arch.num_heads, bias=arch.proj_bias)
        self.out_proj = nn.Linear(arch.intermediate_size, hidden_size, bias=arch.proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, arch.d_conv, groups=conv_dim, bias=arch.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(arch.num_heads))
        self.A_log = nn.Parameter(torch.zeros(arch.num_heads))
        self.D = nn.Parameter(torch.ones(arch.num_heads))
        self.norm = GatedRMSNorm(
            arch.intermediate_size, arch.intermediate_size // arch.n_groups, eps, arch.group_ranks, arch.group
        )
        self.conv_state: torch.Tensor | None = None  # [num_blocks, conv_dim, d_conv] fp32 view
        self.ssm_state: torch.Tensor | None = None  # [num_blocks, H, P, N] fp32 view
        self._tile_buffer: torch.Tensor | None = None  # CPU decode's gather buffer (see _gather_tile)

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
        gate, xbc, dt = self.in_proj(hidden).split([arch.intermediate_size, arch.conv_dim, arch.num_heads], dim=-1)
        out = torch.empty(hidden.shape[0], arch.intermediate_size, dtype=torch.float32, device=hidden.device)
        # Every read of a block happens before any write of it: prefill gathers its states first,
        # decode updates its states tile by tile in place, prefill scatters last.
        update = self._prefill(xbc, dt, out, batch, index) if batch.prefill_chunks else None
        if batch.decode_chunks:
            self._decode(xbc, dt, out, batch, index)
        if update is not None:
            self._scatter(*update)
        out = self.out_proj(self.norm(out, gate, hidden.dtype))
        return all_reduce(out) if self.reduce else out

    def _gather(self, source: torch.Tensor, fresh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the conv windows and SSM states in blocks ``source`` (zeros where ``fresh``)."""
        assert self.conv_state is not None and self.ssm_state is not None, "Mamba state not bound"
        conv, ssm = self.conv_state.index_select(0, source), self.ssm_state.index_select(0, source)
        if fresh is not None:
            conv.masked_fill_(fresh[:, None, None], 0.0)
            ssm.masked_fill_(fresh[:, None, None, None], 0.0)
        return conv, ssm

    def _scatter(self, target: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        assert self.conv_state is not None and self.ssm_state is not None, "Mamba state not bound"
        self.conv_state.index_copy_(0, target, conv)
        self.ssm_state.index_copy_(0, target, ssm)

    def _gather_tile(self, source: torch.Tensor, heads: slice) -> torch.Tensor:
        """The SSM states of ``heads`` in blocks ``source``, ``[B, heads, P, N]``. On CPU into a
        buffer kept between steps: a fresh allocation this size per tile costs page faults that
        dwarf the update itself (GPU allocators cache, so there it is a plain gather)."""
        assert self.ssm_state is not None, "Mamba state not bound"
        states = self.ssm_state[:, heads]
        if states.device.type != "cpu":
            return states.index_select(0, source)
        shape = (source.numel(), *states.shape[1:])
        size = math.prod(shape)
        if self._tile_buffer is None or self._tile_buffer.numel() < size:
            self._tile_buffer = torch.empty(size, dtype=torch.float32)
        return torch.index_select(states, 0, source, out=self._tile_buffer[:size].view(shape))

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
        ``out`` and writes their new states. On the torch path the SSM states are updated a tile
        of heads at a time (all chunks together), so the gathered tile stays in cache through its
        update; with ``triton_mamba.enabled`` it is two kernels (the conv step, then the SSM
        step), which read ``xbc`` and ``dt`` in place."""
        assert self.conv_state is not None and self.ssm_state is not None, "Mamba state not bound"
        m, device = self.arch, xbc.device
        count, heads_per_group = len(batch.decode_chunks), m.num_heads // m.n_groups
        rows, source, fresh, target = recurrent.decode_index(batch, index, device)
        # the kernel choice is read once per step per group, like the index tensors
        if index.shared("mamba2_kernel", lambda: triton_mamba.enabled(device)):
            conv = triton_mamba.conv_decode_update(
                self.conv_state, source, fresh, target, xbc, rows, self.conv1d.weight, self.conv1d.bias
            )
            x, b, c = conv.split([m.intermediate_size, m.n_groups * m.d_state, m.n_groups * m.d_state], dim=-1)
            triton_mamba.ssm_decode_update(
                self.ssm_state,
                source,
                fresh,
                target,
                x.view(count, m.num_heads, m.head_dim),
                dt,
                self.dt_bias,
                (m.time_step_min, m.time_step_max),
                b.view(count, m.n_groups, m.d_state),
                c.view(count, m.n_groups, m.d_state),
                self.A_log,
                self.D,
                out,
                rows,
            )
            return
        conv_prev = self.conv_state.index_select(0, source)
        if fresh is not None:
            conv_prev.masked_fill_(fresh[:, None, None], 0.0)
        window = torch.cat([conv_prev[:, :, 1:], xbc.index_select(0, rows).float()[:, :, None]], dim=2)
        conv = torch.einsum("bck,ck->bc", window, self.conv1d.weight.float()[:, 0, :])
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias.float()
        x, b, c = self._split_conv(F.silu(conv))  # x [B, G, E, P]; b, c [B, G, N]
        x = x.reshape(count, m.num_heads, m.head_dim)
        step = self._step_dt(dt.index_select(0, rows))  # [B, H]
        b, c = (t.repeat_interleave(heads_per_group, dim=1) for t in (b, c))  # [B, H, N]
        rate = torch.exp(step * -torch.exp(self.A_log.float()))
        drive = step[..., None] * x  # [B, H, P]
        y = torch.empty_like(x)
        tile = m.num_heads
        if device.type == "cpu":
            tile = max(1, DECODE_TILE_BYTES // (count * m.head_dim * m.d_state * 4))
        for lo in range(0, m.num_heads, tile):
            heads = slice(lo, lo + tile)
            h = self._gather_tile(source, heads)  # [B, tile, P, N]
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
        """The causal conv and SSD scan of every multi-token chunk at once (tokens packed, longest
        chunk first; see ``engine.model.layers.ssd``); fills their rows of ``out`` and returns their new
        states. With ``triton_ssd.enabled`` (opt-in) the scan is three Triton launches instead of
        ``ssd_scan_packed``'s loop over sub-chunks."""
        m = self.arch
        order, packed, rows, source, fresh, target = prefill_index(batch, index, m.d_conv, xbc.device)
        if source is None:  # all fresh: zero windows, and the scan starts from a zero state
            conv_prev, h0 = torch.zeros(len(order), m.conv_dim, m.d_conv, device=xbc.device), None
        else:
            conv_prev, ssm = self._gather(source, fresh)
            h0 = ssm.view(len(order), m.n_groups, m.num_heads // m.n_groups, m.head_dim, m.d_state)
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        conv, new_conv = causal_conv_packed(
            xbc.index_select(0, rows).float(), conv_prev, self.conv1d.weight.float(), bias, packed
        )
        x, b, c = self._split_conv(F.silu(conv))  # x [n, G, E, P]; b, c [n, G, N]
        step = self._step_dt(dt.index_select(0, rows)).view(x.shape[:3])
        a = -torch.exp(self.A_log.float()).view(x.shape[1:3])
        # the scan whose layout ``prefill_index`` built (the kernel choice, read once per step per group)
        scan = triton_ssd.ssd_scan_packed if packed.sub_chunks is not None else ssd_scan_packed
        y, h = scan(x, step, a, b, c, h0, packed)
        y += x * self.D.float().view(x.shape[1:3])[..., None]
        out.index_copy_(0, rows, y.reshape(-1, m.intermediate_size))
        return target, new_conv, h.view(-1, m.num_heads, m.head_dim, m.d_state)
