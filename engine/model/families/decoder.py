"""Decoder-only transformers of the Llama family (Llama, Qwen2, Mistral, Qwen3, gpt-oss) and Gemma3.

One class covers them: Gemma3 adds q/k norms, pre/post feed-forward norms, ``1 + weight`` RMS
norms, a scaled embedding and per-layer-type rotary bases; Qwen3 adds plain q/k norms; gpt-oss
adds attention sinks and a sparse MoE MLP (``ModelArch.moe``); the rest is shared. Parameter
names follow the Hugging Face checkpoints, so ``load_state_dict`` maps weights by name.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.arch.model_arch import ModelArch
from engine.model.batch import ForwardBatch
from engine.model.families.language_model import DecoderStack, LanguageModel, RopeMemo
from engine.model.layers.attention import Attention
from engine.model.layers.blocks import GatedMLP, PendingResidual, RMSNorm
from engine.model.layers.moe import SparseMoE


class DecoderLayer(nn.Module):
    """One decoder layer: attention and an MLP (dense or sparse MoE), each behind an RMS norm with a
    residual; Gemma3 adds norms after attention and around the MLP."""

    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__()
        gemma = arch.family == "gemma3"
        self.self_attn = Attention(arch, layer, group)
        self.mlp: nn.Module = (
            SparseMoE(arch.moe, arch.hidden_size, reduce=arch.tp_size > 1)
            if arch.moe
            else GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, reduce=arch.tp_size > 1)
        )
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, gemma)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, gemma)
        self.gemma = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, True)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, True)

    def forward(
        self, x: torch.Tensor, pending: PendingResidual | None, batch: ForwardBatch, ropes: RopeMemo
    ) -> tuple[torch.Tensor, PendingResidual]:
        """``pending``: the previous layer's residual add, summed by this layer's input norm;
        ``ropes``: the step's cos/sin per rotary type, shared by all layers
        (``Attention.step_rope``). Returns the hidden state and the MLP's residual add, left to
        the next norm."""
        x, normed = self.input_layernorm.enter(x, pending)
        h = self.self_attn(normed, batch, self.self_attn.step_rope(batch, x.dtype, ropes))
        if self.gemma:
            x, normed = self.post_attention_layernorm.then(h, x, self.pre_feedforward_layernorm)
            return x, PendingResidual(self.mlp(normed), self.post_feedforward_layernorm)
        x, normed = self.post_attention_layernorm.add(h, x)
        return x, PendingResidual(self.mlp(normed))


class CausalLM(LanguageModel):
    """The Llama-family and Gemma3 language model (``LanguageModel`` over ``DecoderLayer``s); Gemma3
    scales the embeddings by ``arch.embed_scale`` (rounded to the model dtype, as HF does) and
    softcaps the logits by ``arch.final_logit_softcapping``."""

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        layers = (DecoderLayer(arch, i, layer_group[i]) for i in range(arch.num_layers))
        super().__init__(arch, DecoderStack(arch, layers, gemma_norm=arch.family == "gemma3"))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.arch.embed_scale != 1.0:
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
