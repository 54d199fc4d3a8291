"""Bamba: a Mamba2 / attention hybrid (IBM). Mamba2 layers keep per-request state in state
blocks; attention layers use paged KV with partial rotary embeddings."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.arch import ModelArch
from engine.model.batch import ForwardBatch
from engine.model.decoder import Attention
from engine.model.layers import GatedMLP, RMSNorm, lm_head
from engine.model.mamba2 import Mamba2Mixer


class FeedForward(GatedMLP):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool):
        super().__init__(hidden, intermediate, act)
        if bias:
            self.gate_proj = nn.Linear(hidden, intermediate, bias=True)
            self.up_proj = nn.Linear(hidden, intermediate, bias=True)
            self.down_proj = nn.Linear(intermediate, hidden, bias=True)


class MambaOrAttentionMixer(nn.Module):
    """The token-mixing half of a Mamba2/attention hybrid layer (Bamba, Granite-4.0-H): behind
    ``input_layernorm``, a Mamba2 mixer (``mamba``: state blocks) when the layer's kind is
    ``mamba``, else attention (``self_attn``: paged KV), under Hugging Face's parameter names.
    Subclasses add the MLP half and the residuals."""

    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__()
        self.is_mamba = arch.layers[layer].kind == "mamba"
        if self.is_mamba:
            assert arch.mamba is not None
            self.mamba = Mamba2Mixer(arch.mamba, arch.hidden_size, group, arch.rms_norm_eps)
        else:
            self.self_attn = Attention(arch, layer, group)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def mix(self, x: torch.Tensor, batch: ForwardBatch, ropes: dict) -> torch.Tensor:
        """The mixer's output for ``input_layernorm(x)``; ``ropes``: the step's rotary memo."""
        h = self.input_layernorm(x)
        if self.is_mamba:
            return self.mamba(h, batch)
        return self.self_attn(h, batch, self.self_attn.step_rope(batch, x.dtype, ropes))


class BambaLayer(MambaOrAttentionMixer):
    """One Bamba layer: the mixer, then ``feed_forward`` behind ``pre_ff_layernorm``, each with a residual."""

    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__(arch, layer, group)
        self.feed_forward = FeedForward(arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.mlp_bias)
        self.pre_ff_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, ropes: dict) -> torch.Tensor:
        x = x + self.mix(x, batch, ropes)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaModel(nn.Module):
    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(BambaLayer(arch, i, layer_group[i]) for i in range(arch.num_layers))
        self.final_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class BambaLM(nn.Module):
    """Same interface as ``CausalLM``: ``forward(batch)`` -> hidden states, ``logits(rows)``."""

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        super().__init__()
        self.arch = arch
        self.model = BambaModel(arch, layer_group)
        self.lm_head = lm_head(arch.hidden_size, arch.vocab_size, self.model.embed_tokens, arch.tie_word_embeddings)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        ropes: dict = {}
        for layer in self.model.layers:
            x = layer(x, batch, ropes)
        return self.model.final_layernorm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
