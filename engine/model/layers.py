"""Building blocks: RMSNorm (Llama and Gemma styles), rotary embedding, gated MLP, paged attention.

Module names match Hugging Face checkpoints (``q_proj``, ``input_layernorm`` ...) so weights load
by name. Attention reads and writes KV through the step's ``GroupIndex`` only; it never sees the
coordinator or the cache layout beyond its own typed page view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import triton_attention, triton_norm
from engine.model.arch import RopeArch
from engine.model.batch import ForwardBatch, GroupIndex, slot_table_reads


class RMSNorm(nn.Module):
    """RMS normalisation in fp32; Gemma scales by ``1 + weight`` (zero-initialised weights).

    ``forward(x, residual)`` returns ``residual + norm(x)`` when a residual is given (the
    decoder's post-norm adds). Where ``triton_norm.enabled`` (CUDA) the norm, its casts and the
    add are one Triton kernel; elsewhere one fused ``F.rms_norm`` between two casts (a norm is 9
    small ops written out). Gemma's ``1 + weight`` is kept between calls and rebuilt when the
    weight changes (its storage or ``_version``)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self._gemma_scale: tuple[tuple[int, int], torch.Tensor] | None = None  # (weight storage+version, 1 + w)
        self._kernel: bool | None = None  # triton_norm.enabled for the weight's device, read at first use

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self._kernel is None:
            self._kernel = triton_norm.enabled(self.weight.device)
        if self._kernel:
            return triton_norm.rms_norm(x, self.weight_for_kernel(), self.eps, self.gemma, residual)
        dtype, shape = x.dtype, (x.shape[-1],)
        if self.gemma:
            out = F.rms_norm(x.float(), shape, self._scale(), self.eps).to(dtype)
        else:
            out = self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(dtype)
        return out if residual is None else residual + out

    def weight_for_kernel(self) -> torch.Tensor:
        """What the Triton kernels take as this norm's weight: Gemma's fp32 ``1 + weight``, else
        the weight itself."""
        return self._scale() if self.gemma else self.weight

    def _scale(self) -> torch.Tensor:
        """``1 + weight`` in fp32, rebuilt when the weight is written or replaced."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._gemma_scale is None or self._gemma_scale[0] != key:
            with torch.no_grad():
                self._gemma_scale = (key, 1.0 + self.weight.float())
        return self._gemma_scale[1]


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention) for one layer type."""

    inv_freq: torch.Tensor  # a buffer (``register_buffer`` in ``__init__``)

    def __init__(self, rope: RopeArch, head_dim: int):
        super().__init__()
        inv_freq = torch.tensor(rope.inv_freq(head_dim), dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = rope.rotary_dim or head_dim
        self.attention_factor = rope.attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for ``positions``, ``[T, rotary_dim]``: the sin's first half is
        negated here, once per step, so ``apply`` needs no negation per layer."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # not nn.Module.apply(fn): the rotation
        """``x``: [T, heads, head_dim]; ``cos``/``sin``: ``cos_sin``'s [T, rotary_dim]. The
        rotate-half convention ``x * cos + cat(-x2, x1) * sin`` as ``x * cos + cat(x2, x1) * sin'``
        with ``sin' = cat(-sin, sin)`` (the same products, bit for bit)."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        swapped = rot.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # cat(x2, x1)
        out = rot * cos[:, None, :] + swapped * sin[:, None, :]
        return torch.cat((out, rest), dim=-1) if rest.numel() else out


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config's ``hidden_act`` names; an unknown name is an error naming it."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act: {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def lm_head(hidden_size: int, vocab_size: int, embedding: nn.Embedding, tied: bool) -> nn.Linear:
    """The output projection (no bias); with ``tied`` it shares ``embedding``'s weight."""
    head = nn.Linear(hidden_size, vocab_size, bias=False)
    if tied:
        head.weight = embedding.weight
    return head


def fuse_linears(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``linears``' output rows back to back, so one matmul computes
    them all; each linear's parameters become views of it, so checkpoint names, ``state_dict`` and
    ``load_state_dict`` still address them (and a load writes through to the fused tensor)."""
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        has_bias = all(linear.bias is not None for linear in linears)
        bias = torch.cat([linear.bias for linear in linears]) if has_bias else None
        start = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
    return weight, bias


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; after ``fuse_projections`` gate and up are one matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        activation(act)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _ACTIVATIONS[act]
        self._gate_up: torch.Tensor | None = None  # fused gate + up weight (fuse_projections)

    def fuse_projections(self) -> None:
        """Concatenate the gate and up weights once, after the checkpoint is loaded."""
        self._gate_up, _ = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self._gate_up).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    flat: torch.Tensor,
    rows_per_block: int,
    block_size: int,
    index: GroupIndex,
    batch: ForwardBatch,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's K/V in the layer's cache and attend. ``q``: [T, heads, head_dim];
    ``k``/``v``: [T, kv_heads, head_dim]. Returns [T, heads, head_dim]. ``sinks`` ([heads]): a
    learned logit per head joining every softmax denominator (it takes probability mass but
    contributes no value), in prefill and decode alike.

    ``flat`` is the cache as rows ``[num_blocks * rows_per_block, kv_heads, head_dim]``: block b's
    page starts at row ``rows_per_block * b`` and holds ``block_size`` key rows then
    ``block_size`` value rows, so reads and writes are single ``index_select`` / ``index_copy_``
    calls. Prefill chunks attend one by one with a causal (and window) mask; decode tokens are
    batched into one padded call. With ``index.paged`` (the Triton path) one fused store and one
    attention launch read the cache in place instead.
    """
    kv_heads, head_dim = flat.shape[1], flat.shape[2]
    bs, stride = block_size, rows_per_block
    key_rows = index.write_block * stride + index.write_offset
    if index.paged is not None:
        triton_attention.store_kv(flat, k, v, key_rows, bs)
        return triton_attention.paged_attention_triton(
            q, flat, stride, bs, index.paged, scale, softcap, sinks, index.paged.window
        )
    flat.index_copy_(0, key_rows, k)
    flat.index_copy_(0, key_rows + bs, v)
    out = torch.empty_like(q)
    for c, blocks, offsets, allowed in index.prefill_reads:
        chunk = batch.chunks[c]
        sl = slice(chunk.offset, chunk.offset + chunk.num_tokens)
        rows = blocks * stride + offsets
        kbuf, vbuf = batch.scratch or (None, None)
        keys = _gather(flat, rows, kbuf).transpose(0, 1)[None]
        values = _gather(flat, rows + bs, vbuf).transpose(0, 1)[None]
        out[sl] = _attend(q[sl].transpose(0, 1)[None], keys, values, allowed[None, None], scale, softcap, sinks)[
            0
        ].transpose(0, 1)
    if batch.decode_chunks:
        query_rows = torch.tensor([batch.chunks[c].offset for c in batch.decode_chunks], device=q.device)
        if index.slot_tables is not None:  # a static decode batch: gathers from its slot tables
            blocks, offsets, valid = slot_table_reads(index, batch.positions, bs)
        else:
            blocks, offsets, valid = index.decode_block, index.decode_offset, index.decode_valid  # type: ignore[assignment]  # set for every batch with decode chunks
        rows = (blocks * stride + offsets).reshape(-1)
        shape = (*blocks.shape, kv_heads, head_dim)
        kbuf, vbuf = batch.scratch or (None, None)
        keys = _gather(flat, rows, kbuf).view(shape).permute(0, 2, 1, 3)
        values = _gather(flat, rows + bs, vbuf).view(shape).permute(0, 2, 1, 3)
        mask = valid[:, None, None, :]
        out[query_rows] = _attend(q[query_rows][:, :, None, :], keys, values, mask, scale, softcap, sinks)[:, :, 0, :]
    return out


def _gather(flat: torch.Tensor, rows: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """``flat[rows]`` into a reused buffer: allocating a fresh multi-MB tensor per call (and
    faulting its pages in) costs several times the copy itself on CPU."""
    shape = (rows.numel(), *flat.shape[1:])
    size = shape[0] * shape[1] * shape[2]
    if buffer is None or buffer.numel() < size:
        return flat.index_select(0, rows)
    out = buffer[:size].view(shape)
    torch.index_select(flat, 0, rows, out=out)
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, H, Tq, D]; k/v: [B, KVH, S, D]; mask: bool [B or 1, 1, Tq or 1, S];
    sinks: [H] extra softmax logits whose probability is dropped (no value row).

    Without softcap or sinks this is SDPA. Otherwise each KV head's ``G = H / KVH`` query heads
    are folded into the query rows (``[B, KVH, G * Tq, D]``) so K and V are never repeated, and the
    sink joins the softmax denominator without concatenating a column."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, h, tq, d = q.shape
    kvh = k.shape[1]
    groups = h // kvh
    folded = q.reshape(b, kvh, groups * tq, d)
    scores = torch.matmul(folded, k.transpose(-1, -2)) * scale  # [B, KVH, G * Tq, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kvh, groups, tq, -1).masked_fill(~mask[:, :, None], float("-inf")).float()
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        # softmax over [scores, sink] without the sink column = softmax(scores) * sigmoid(lse - sink)
        sink = sinks.float().view(1, kvh, groups, 1, 1)
        keep = torch.sigmoid(torch.logsumexp(scores, dim=-1, keepdim=True) - sink)
        probs = torch.softmax(scores, dim=-1).mul_(keep)
    out = torch.matmul(probs.to(q.dtype).view(b, kvh, groups * tq, -1), v)  # [B, KVH, G * Tq, D]
    return out.view(b, h, tq, d)
