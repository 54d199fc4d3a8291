"""Paged attention: the ``Attention`` layer (q/k/v/o projections, optional q/k norms, rotary or
NoPE, attention sinks) and ``paged_attention``, the store-and-attend over a layer's paged KV.

Module names match Hugging Face checkpoints (``q_proj`` ...) so weights load by name. Attention
reads and writes KV through the step's ``GroupIndex`` only; it never sees the coordinator or the
cache layout beyond its own typed page view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch.model_arch import ModelArch
from engine.model.batch import ForwardBatch, GroupIndex, slot_table_reads
from engine.model.kernels import triton_attention, triton_rope, triton_split_decode
from engine.model.layers.blocks import RMSNorm, Rotary, fuse_linears
from engine.model.layers.parallel import all_reduce


class Attention(nn.Module):
    sinks: nn.Parameter | None  # a parameter (``register_parameter`` in ``__init__``)

    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__()
        gemma = arch.family == "gemma3"
        self.arch = arch
        self.group = group
        self.window = arch.layers[layer].window
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        bias = arch.attention_bias
        self.q_proj = nn.Linear(arch.hidden_size, arch.num_heads * arch.head_dim, bias=bias)
        self.k_proj = nn.Linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=bias)
        self.o_proj = nn.Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.output_bias)
        self.qk_norm = gemma or arch.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, gemma=gemma)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, gemma=gemma)
        self.register_parameter("sinks", nn.Parameter(torch.empty(arch.num_heads)) if arch.attention_sinks else None)
        self.rope_key = arch.layers[layer].rope
        rope = arch.layers[layer].rope
        self.rotary = Rotary(rope, arch.head_dim) if rope is not None else None  # None: NoPE
        self.cache: torch.Tensor | None = None  # set by the runner: rows [n, kv_heads, head_dim]
        self.rows_per_block = 0
        self.block_size = 0
        self._fused_rope: bool | None = None  # triton_rope.enabled for the weights' device, at first use
        #: cos / sign-folded sin of every position (``bind_rope_table``; fused path only), else None
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        #: the split decode kernel's counters (``bind_cache``, where ``triton_split_decode`` is on)
        self.split_counters: torch.Tensor | None = None
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused q, k, v weight and bias
        self._qkv_sizes = (
            arch.num_heads * arch.head_dim,
            arch.num_kv_heads * arch.head_dim,
            arch.num_kv_heads * arch.head_dim,
        )

    def fuse_projections(self) -> None:
        """Concatenate the q, k and v projections once, after the checkpoint is loaded."""
        self._qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def step_rope(
        self, batch: ForwardBatch, dtype: torch.dtype, ropes: dict
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's rotary cos/sin for the step's positions (None for NoPE), computed once per
        rotary type: ``ropes`` (rope_key -> cos/sin) is the step's memo shared by all layers. With
        a bound table (``bind_rope_table``) the table itself: the kernel reads the positions' rows."""
        if self.rotary is None:
            return None
        if self.rope_table is not None:
            return self.rope_table
        if self.rope_key not in ropes:
            ropes[self.rope_key] = self.rotary.cos_sin(batch.positions, dtype)
        return ropes[self.rope_key]

    def bind_rope_table(self, max_positions: int, shared: dict[object, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """On the fused rotary path (``triton_rope.enabled``), take this rotary type's cos and
        sign-folded sin of every position below ``max_positions`` (``Rotary.cos_sin`` of them,
        built once per type in ``shared``), so a step computes none: the kernel reads each token's
        row by its position, the values the step would have computed. Elsewhere nothing changes."""
        weight = self.q_proj.weight
        self._fused_rope = triton_rope.enabled(weight.device)  # the choice forward reads
        if self.rotary is None or not self._fused_rope:
            return
        if self.rope_key not in shared:
            shared[self.rope_key] = self.rotary.cos_sin(torch.arange(max_positions, device=weight.device), weight.dtype)
        self.rope_table = shared[self.rope_key]

    def bind_cache(self, slot: torch.Tensor, block_size: int) -> None:
        """Take ``slot`` (``[num_blocks, page_bytes]`` uint8) as this layer's paged KV: each page
        holds K rows then V rows of ``[kv_heads, head_dim]`` in the model dtype."""
        dtype = self.q_proj.weight.dtype
        row_bytes = self.num_kv_heads * self.head_dim * dtype.itemsize
        self.rows_per_block = slot.shape[1] // row_bytes
        self.block_size = block_size
        self.cache = slot.view(dtype).view(slot.shape[0] * self.rows_per_block, self.num_kv_heads, self.head_dim)
        self.split_counters = triton_split_decode.make_counters(slot.device)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """``rope``: this layer type's cos/sin for the step's positions (None for a NoPE layer)."""
        t = x.shape[0]
        if self._qkv is not None:  # one matmul for q, k and v (fuse_projections)
            q, k, v = F.linear(x, *self._qkv).split(self._qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self._fused_rope is None:
            self._fused_rope = triton_rope.enabled(self.q_proj.weight.device)
        index = batch.groups[self.group]
        stored = False
        assert self.cache is not None, "KV cache not bound"
        if self.rotary is not None and self._fused_rope:  # q/k norms, rotary (and the KV store): one launch
            assert rope is not None, "rotary layer called without cos/sin"
            norms = (self.q_norm.weight_for_kernel(), self.k_norm.weight_for_kernel()) if self.qk_norm else None
            stored = index.paged is not None  # the paged path stores K/V itself; the torch path after
            store = (v, self.cache, index.write_block, index.write_offset, self.rows_per_block, self.block_size)
            q, k = triton_rope.norm_rope(
                q,
                k,
                *rope,
                self.rotary.rotary_dim,
                norms,
                self.arch.rms_norm_eps,
                self.arch.family == "gemma3",
                store if stored else None,
                batch.positions if self.rope_table is not None else None,
            )
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotary is not None:
                assert rope is not None, "rotary layer called without cos/sin"
                cos, sin = rope
                q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        out = paged_attention(
            q,
            k,
            v,
            self.cache,
            self.rows_per_block,
            self.block_size,
            batch.groups[self.group],
            batch,
            self.arch.attn_scale,
            self.arch.attn_logit_softcapping,
            self.sinks,
            stored,
            self.split_counters,
        )
        out = self.o_proj(out.reshape(t, -1))
        return all_reduce(out) if self.arch.tp_size > 1 else out  # row-parallel o: sum the ranks' heads


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
    stored: bool = False,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's K/V in the layer's cache (unless ``stored``: the fused rotary kernel wrote
    them, paged path only) and attend. ``q``: [T, heads, head_dim];
    ``k``/``v``: [T, kv_heads, head_dim]. Returns [T, heads, head_dim]. ``sinks`` ([heads]): a
    learned logit per head joining every softmax denominator (it takes probability mass but
    contributes no value), in prefill and decode alike.

    ``flat`` is the cache as rows ``[num_blocks * rows_per_block, kv_heads, head_dim]``: block b's
    page starts at row ``rows_per_block * b`` and holds ``block_size`` key rows then
    ``block_size`` value rows, so reads and writes are single ``index_select`` / ``index_copy_``
    calls. Prefill chunks attend one by one with a causal (and window) mask; decode tokens are
    batched into one padded call. With ``index.paged`` (the Triton path) one fused store and one
    attention launch read the cache in place instead; given ``split_counters``, a launch of
    decode tokens only splits each token's keys over several programs (``triton_split_decode``).
    """
    kv_heads, head_dim = flat.shape[1], flat.shape[2]
    bs, stride = block_size, rows_per_block
    if index.paged is not None:
        if not stored:
            triton_attention.store_kv(flat, k, v, index.write_block * stride + index.write_offset, bs)
        if split_counters is not None:
            split = triton_split_decode.split_decode(
                q, flat, stride, bs, index.paged, scale, softcap, sinks, split_counters
            )
            if split is not None:
                return split
        return triton_attention.paged_attention_triton(
            q, flat, stride, bs, index.paged, scale, softcap, sinks, index.paged.window
        )
    assert not stored, "the torch path stores K/V itself"
    key_rows = index.write_block * stride + index.write_offset
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
