"""Decoder-only transformers of the Llama family (Llama, Qwen2, Mistral, Qwen3, gpt-oss) and Gemma3.

One class covers them: Gemma3 adds q/k norms, pre/post feed-forward norms, ``1 + weight`` RMS
norms, a scaled embedding and per-layer-type rotary bases; Qwen3 adds plain q/k norms; gpt-oss
adds attention sinks and a sparse MoE MLP (``ModelArch.moe``); the rest is shared. Parameter
names follow the Hugging Face checkpoints, so ``load_state_dict`` maps weights by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import triton_rope
from engine.model.arch import ModelArch
from engine.model.batch import ForwardBatch
from engine.model.layers import GatedMLP, RMSNorm, Rotary, fuse_linears, lm_head, paged_attention
from engine.model.moe import SparseMoE


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
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused q, k, v weight and bias
        self._qkv_sizes = (arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim,
                           arch.num_kv_heads * arch.head_dim)  # fmt: skip

    def fuse_projections(self) -> None:
        """Concatenate the q, k and v projections once, after the checkpoint is loaded."""
        self._qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def step_rope(
        self, batch: ForwardBatch, dtype: torch.dtype, ropes: dict
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's rotary cos/sin for the step's positions (None for NoPE), computed once per
        rotary type: ``ropes`` (rope_key -> cos/sin) is the step's memo shared by all layers."""
        if self.rotary is None:
            return None
        if self.rope_key not in ropes:
            ropes[self.rope_key] = self.rotary.cos_sin(batch.positions, dtype)
        return ropes[self.rope_key]

    def bind_cache(self, slot: torch.Tensor, block_size: int) -> None:
        """Take ``slot`` (``[num_blocks, page_bytes]`` uint8) as this layer's paged KV: each page
        holds K rows then V rows of ``[kv_heads, head_dim]`` in the model dtype."""
        dtype = self.q_proj.weight.dtype
        row_bytes = self.num_kv_heads * self.head_dim * dtype.itemsize
        self.rows_per_block = slot.shape[1] // row_bytes
        self.block_size = block_size
        self.cache = slot.view(dtype).view(slot.shape[0] * self.rows_per_block, self.num_kv_heads, self.head_dim)

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
        if self.rotary is not None and self._fused_rope:  # q/k norms and rotary: one launch
            assert rope is not None, "rotary layer called without cos/sin"
            norms = (self.q_norm.weight_for_kernel(), self.k_norm.weight_for_kernel()) if self.qk_norm else None
            q, k = triton_rope.norm_rope(q, k, *rope, self.rotary.rotary_dim, norms, self.arch.rms_norm_eps,
                                         self.arch.family == "gemma3")  # fmt: skip
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotary is not None:
                assert rope is not None, "rotary layer called without cos/sin"
                cos, sin = rope
                q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        assert self.cache is not None, "KV cache not bound"
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
        )
        return self.o_proj(out.reshape(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__()
        gemma = arch.family == "gemma3"
        self.self_attn = Attention(arch, layer, group)
        self.mlp: nn.Module = (
            SparseMoE(arch.moe, arch.hidden_size)
            if arch.moe
            else GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)
        )
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, gemma)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, gemma)
        self.gemma = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, True)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, True)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, ropes: dict[object, tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """``ropes``: the step's cos/sin per rotary type, shared by all layers (``Attention.step_rope``)."""
        h = self.self_attn(self.input_layernorm(x), batch, self.self_attn.step_rope(batch, x.dtype, ropes))
        if self.gemma:
            x = self.post_attention_layernorm(h, residual=x)
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)), residual=x)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and final norm (HF's ``model.*`` weights)."""

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, layer_group[i]) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family == "gemma3")


class CausalLM(nn.Module):
    """The language model: ``forward`` returns hidden states for the step's tokens;
    ``logits`` projects only the rows to sample (prefill never projects every position)."""

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch, layer_group)
        self.lm_head = lm_head(arch.hidden_size, arch.vocab_size, self.model.embed_tokens, arch.tie_word_embeddings)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        if self.arch.embed_scale != 1.0:
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        ropes: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}  # one cos/sin per layer type
        for layer in self.model.layers:
            x = layer(x, batch, ropes)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
