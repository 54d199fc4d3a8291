"""Qwen3-Next: Gated DeltaNet layers (recurrent state in state blocks) interleaved with gated
full attention layers (paged KV), a sparse MoE MLP with a gated shared expert, ``1 + weight``
RMS norms throughout. Parameter names follow Hugging Face's ``Qwen3NextForCausalLM``."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.arch.model_arch import ModelArch
from engine.model.batch import ForwardBatch
from engine.model.families.language_model import DecoderStack, LanguageModel, RopeMemo
from engine.model.layers.attention import Attention, paged_attention
from engine.model.layers.blocks import GatedMLP, PendingResidual, RMSNorm
from engine.model.layers.gated_deltanet import GatedDeltaNet
from engine.model.layers.moe import SparseMoE
from engine.model.layers.parallel import all_reduce


class GatedAttention(Attention):
    """Full attention whose ``q_proj`` also yields a per-channel output gate: per head, the
    first ``head_dim`` outputs are the query, the next ``head_dim`` the gate; the attention output
    is scaled by ``sigmoid(gate)`` before ``o_proj``. q/k norms scale by ``1 + weight``."""

    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__(arch, layer, group)
        self.q_proj = nn.Linear(arch.hidden_size, 2 * arch.num_heads * arch.head_dim, bias=arch.attention_bias)
        self.qk_norm = True
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, gemma=True)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, gemma=True)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """``rope``: the step's cos/sin for this layer (Qwen3-Next's attention layers all rotate)."""
        assert self.rotary is not None and rope is not None, "gated attention needs a rotary embedding"
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
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
        )
        out = self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))
        return all_reduce(out) if self.arch.tp_size > 1 else out  # row-parallel o: sum the ranks' heads


class Qwen3NextLayer(nn.Module):
    """One decoder layer: a token mixer (``linear_attn`` or ``self_attn``) and an MLP (sparse MoE
    or dense), each behind a ``1 + weight`` RMS norm with a residual."""

    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__()
        self.is_linear = arch.layers[layer].kind == "linear_attention"
        if self.is_linear:
            assert arch.gated_deltanet is not None, "linear_attention layers need ModelArch.gated_deltanet"
            self.linear_attn = GatedDeltaNet(
                arch.gated_deltanet, arch.hidden_size, group, arch.rms_norm_eps, reduce=arch.tp_size > 1
            )
        else:
            self.self_attn = GatedAttention(arch, layer, group)
        self.mlp: nn.Module = (
            SparseMoE(arch.moe, arch.hidden_size, reduce=arch.tp_size > 1)
            if arch.moe is not None and layer not in arch.dense_mlp_layers
            else GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, reduce=arch.tp_size > 1)
        )
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, gemma=True)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, gemma=True)

    def forward(
        self, x: torch.Tensor, pending: PendingResidual | None, batch: ForwardBatch, ropes: RopeMemo
    ) -> tuple[torch.Tensor, PendingResidual]:
        """The hidden state and the MLP's residual add, left to the next norm."""
        x, h = self.input_layernorm.enter(x, pending)
        if self.is_linear:
            h = self.linear_attn(h, batch)
        else:
            h = self.self_attn(h, batch, self.self_attn.step_rope(batch, x.dtype, ropes))
        x, h = self.post_attention_layernorm.add(h, x)
        return x, PendingResidual(self.mlp(h))


class Qwen3NextLM(LanguageModel):
    """Qwen3NextForCausalLM: ``LanguageModel`` over ``Qwen3NextLayer``s with a ``1 + weight`` final
    norm; the multi-token-prediction head (``mtp.*``) is not used to decode, so the loader drops it."""

    IGNORED_WEIGHT_PREFIXES = ("mtp.",)

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        layers = (Qwen3NextLayer(arch, i, layer_group[i]) for i in range(arch.num_layers))
        super().__init__(arch, DecoderStack(arch, layers, gemma_norm=True))
