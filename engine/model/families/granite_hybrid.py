"""GraniteMoeHybrid (IBM Granite-4.0-H): Mamba2 and attention layers, each followed by a dense
``shared_mlp`` plus (with experts) a sparse MoE, with Granite's scalar multipliers.

Per layer::

    h = x + residual_multiplier * mixer(input_layernorm(x))        # mixer: Mamba2 or attention
    y = post_attention_layernorm(h)
    out = h + residual_multiplier * (shared_mlp(y) [+ block_sparse_moe(y)])

Embeddings are scaled by ``embedding_multiplier``, attention scores by ``attention_multiplier``
(instead of 1/sqrt(head_dim)), logits divided by ``logits_scaling``. Attention uses rotary
embeddings only with ``position_embedding_type: rope``. Parameter names follow the Hugging Face
checkpoints (``model.layers.{i}.mamba.*``, ``self_attn.*``, ``shared_mlp.*``,
``block_sparse_moe.*``), so weights load by name.
"""

from __future__ import annotations

import torch

from engine.model.arch.model_arch import ModelArch
from engine.model.batch import ForwardBatch
from engine.model.families.bamba import MambaOrAttentionMixer
from engine.model.families.language_model import DecoderStack, LanguageModel, RopeMemo
from engine.model.layers.blocks import PendingResidual, RMSNorm
from engine.model.layers.moe import FusedGatedMLP, SparseMoE
from engine.model.layers.parallel import all_reduce, gather_vocab


class GraniteHybridLayer(MambaOrAttentionMixer):
    """One decoder layer: a Mamba2 mixer or an attention layer, then the shared MLP (+ MoE)."""

    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__(arch, layer, group)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.shared_mlp = FusedGatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)
        self.block_sparse_moe = SparseMoE(arch.moe, arch.hidden_size) if arch.moe is not None else None
        self.residual_multiplier = arch.residual_multiplier
        self.reduce = arch.tp_size > 1

    def forward(
        self, x: torch.Tensor, pending: PendingResidual | None, batch: ForwardBatch, ropes: RopeMemo
    ) -> tuple[torch.Tensor, PendingResidual]:
        """The hidden state and the MLPs' scaled residual add, left to the next norm."""
        x, mixed = self.mix(x, pending, batch, ropes)
        x, h = self.post_attention_layernorm.add(mixed * self.residual_multiplier, x)
        mlp = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            mlp = self.block_sparse_moe(h) + mlp
        if self.reduce:  # both MLPs hold a slice of their width: one sum over the ranks
            mlp = all_reduce(mlp)
        return x, PendingResidual(mlp * self.residual_multiplier)


class GraniteHybridLM(LanguageModel):
    """GraniteMoeHybridForCausalLM: ``LanguageModel`` over ``GraniteHybridLayer``s, with the
    embeddings scaled by ``embedding_multiplier`` and the logits divided by ``logits_scaling``."""

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        layers = (GraniteHybridLayer(arch, i, layer_group[i]) for i in range(arch.num_layers))
        super().__init__(arch, DecoderStack(arch, layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.arch.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (self.lm_head(hidden) / self.arch.logits_scaling).float()
        return gather_vocab(logits) if self.arch.tp_size > 1 else logits  # every rank's vocabulary slice
