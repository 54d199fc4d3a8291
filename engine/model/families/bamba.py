"""Bamba: a Mamba2 / attention hybrid (IBM). Mamba2 layers keep per-request state in state
blocks; attention layers use paged KV with partial rotary embeddings."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.arch.model_arch import ModelArch
from engine.model.batch import ForwardBatch
from engine.model.families.language_model import LanguageModel, RopeMemo
from engine.model.layers.attention import Attention
from engine.model.layers.blocks import GatedMLP, PendingResidual, RMSNorm
from engine.model.layers.mamba2 import Mamba2Mixer
from engine.model.layers.parallel import token_embedding


class FeedForward(GatedMLP):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, reduce: bool = False):
        super().__init__(hidden, intermediate, act, reduce)
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
            self.mamba = Mamba2Mixer(arch.mamba, arch.hidden_size, group, arch.rms_norm_eps, reduce=arch.tp_size > 1)
        else:
            self.self_attn = Attention(arch, layer, group)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def mix(
        self, x: torch.Tensor, pending: PendingResidual | None, batch: ForwardBatch, ropes: RopeMemo
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state (``x`` with the previous layer's ``pending`` add summed in by
        ``input_layernorm``) and the mixer's output for it normalised; ``ropes``: the step's
        rotary memo."""
        x, h = self.input_layernorm.enter(x, pending)
        if self.is_mamba:
            return x, self.mamba(h, batch)
        return x, self.self_attn(h, batch, self.self_attn.step_rope(batch, x.dtype, ropes))


class BambaLayer(MambaOrAttentionMixer):
    """One Bamba layer: the mixer, then ``feed_forward`` behind ``pre_ff_layernorm``, each with a residual."""

    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__(arch, layer, group)
        self.feed_forward = FeedForward(
            arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.mlp_bias, reduce=arch.tp_size > 1
        )
        self.pre_ff_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, pending: PendingResidual | None, batch: ForwardBatch, ropes: RopeMemo
    ) -> tuple[torch.Tensor, PendingResidual]:
        """The hidden state and the feed-forward's residual add, left to the next norm."""
        x, h = self.mix(x, pending, batch, ropes)
        x, normed = self.pre_ff_layernorm.add(h, x)
        return x, PendingResidual(self.feed_forward(normed))


class BambaModel(nn.Module):
    """Owns the embedding, the layers and the final norm under HF's ``model.*`` names (the norm is
    ``final_layernorm``)."""

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        super().__init__()
        self.embed_tokens = token_embedding(arch)
        self.layers = nn.ModuleList(BambaLayer(arch, i, layer_group[i]) for i in range(arch.num_layers))
        self.final_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    @property
    def norm(self) -> RMSNorm:
        """The final norm under the name ``LanguageModel`` reads."""
        return self.final_layernorm


class BambaLM(LanguageModel):
    """BambaForCausalLM: ``LanguageModel`` over ``BambaLayer``s, no embedding or logit scaling."""

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        super().__init__(arch, BambaModel(arch, layer_group))
