"""Nemotron-H (NVIDIA): a stack of single-mixer blocks, ``x + mixer(norm(x))``, where the mixer
is a Mamba2 layer (``M``), attention without position embedding (``*``), a relu2 MLP (``-``) or a
sigmoid-routed MoE of relu2 experts plus a shared expert (``E``).

Only Mamba2 and attention layers keep a cache; MLP and MoE layers have none (layer kind ``mlp``).
Parameter names follow the Hugging Face checkpoints (``backbone.embeddings``,
``backbone.layers.{i}.norm`` / ``.mixer.*``, ``backbone.norm_f``, ``lm_head``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch.model_arch import ModelArch, MoEArch
from engine.model.batch import ForwardBatch
from engine.model.families.language_model import LanguageModel, RopeMemo
from engine.model.layers.attention import Attention
from engine.model.layers.blocks import PendingResidual, RMSNorm, activation
from engine.model.layers.mamba2 import Mamba2Mixer
from engine.model.layers.parallel import all_reduce, token_embedding


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (Nemotron's ``mlp_hidden_act: relu2``)."""
    return torch.square(F.relu(x))


def _act(name: str):
    return relu2 if name == "relu2" else activation(name)


class NemotronMLP(nn.Module):
    """``down_proj(act(up_proj(x)))``: no gate (MLP layers, experts and the shared expert).
    ``reduce``: a tensor-parallel rank's slice of the width, its output summed over the ranks."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False, reduce: bool = False):
        super().__init__()
        self.reduce = reduce
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.up_proj(x)))
        return all_reduce(out) if self.reduce else out


class NemotronRouter(nn.Module):
    """Sigmoid top-k routing with a score-correction bias and group-limited choice (the
    DeepSeek-V3 router): ``weight`` [E, H], ``e_score_correction_bias`` [E]."""

    e_score_correction_bias: torch.Tensor  # a buffer (``register_buffer`` in ``__init__``)

    def __init__(self, moe: MoEArch, hidden: int):
        super().__init__()
        if moe.num_experts % moe.n_group or not 0 < moe.topk_group <= moe.n_group:
            raise ValueError(
                f"moe.n_group: {moe.n_group} groups / topk_group {moe.topk_group} do not fit {moe.num_experts} experts"
            )
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))

    def _apply(self, fn, recurse: bool = True):
        """Stay in fp32 whatever dtype the model is cast to (as HF keeps ``gate.weight`` and
        ``e_score_correction_bias``): near-equal expert scores must not be reordered by rounding."""
        super()._apply(fn, recurse)
        self.weight.data = self.weight.data.float()
        self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the ``top_k`` routing weights (fp32) and expert ids."""
        moe = self.moe
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if moe.n_group > 1:
            grouped = choice.view(-1, moe.n_group, moe.num_experts // moe.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(-1, moe.num_experts)
        experts = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, experts


class NemotronMoE(nn.Module):
    """Owns one MoE layer's router, ``experts.{e}`` (relu2 MLPs), ``shared_experts`` and the
    optional latent projections. Invariant: each token's output is the routing-weighted sum of
    exactly its ``top_k`` experts (run in the latent space when ``latent_size``) plus the shared
    expert on the token itself. Dispatch: (token, expert) pairs sorted by expert once, one matmul
    per expert that received tokens, one ``index_add_`` back (no loop over tokens). ``reduce``: a
    tensor-parallel rank's slice of every expert's width (the router and the latent projections
    whole), the block's output summed over the ranks once."""

    def __init__(self, moe: MoEArch, hidden: int, bias: bool, reduce: bool = False):
        super().__init__()
        self.moe = moe
        self.reduce = reduce
        width = moe.latent_size or hidden
        self.gate = NemotronRouter(moe, hidden)
        self.experts = nn.ModuleList(
            NemotronMLP(width, moe.intermediate_size, moe.hidden_act) for _ in range(moe.num_experts)
        )
        self.shared_experts = NemotronMLP(hidden, moe.shared_intermediate_size, moe.hidden_act, bias)
        if moe.latent_size:
            self.fc1_latent_proj = nn.Linear(hidden, moe.latent_size, bias=bias)
            self.fc2_latent_proj = nn.Linear(moe.latent_size, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        routed = self.fc1_latent_proj(x) if self.moe.latent_size else x
        k = self.moe.top_k
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        grouped = routed.index_select(0, tokens)
        results = torch.empty(grouped.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                results[start : start + n] = self.experts[expert](grouped[start : start + n]).float()
                start += n
        results.mul_(weights.reshape(-1).index_select(0, order)[:, None])
        out = torch.zeros(routed.shape, dtype=torch.float32, device=x.device).index_add_(0, tokens, results)
        out = out.to(x.dtype)
        if self.moe.latent_size:
            out = self.fc2_latent_proj(out)
        out = out + self.shared_experts(x)
        return all_reduce(out) if self.reduce else out


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))`` with the mixer its layer kind names (the add left to the next norm)."""

    def __init__(self, arch: ModelArch, layer: int, group: int):
        super().__init__()
        spec = arch.layers[layer]
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.kind = spec.kind
        tp = arch.tp_size > 1  # this rank holds a slice of the mixer: its output is summed over the ranks
        self.mixer: nn.Module
        if spec.kind == "mamba":
            assert arch.mamba is not None
            self.mixer = Mamba2Mixer(arch.mamba, arch.hidden_size, group, arch.rms_norm_eps, reduce=tp)
        elif spec.kind == "full_attention":
            self.mixer = Attention(arch, layer, group)
        elif spec.moe:
            assert arch.moe is not None
            self.mixer = NemotronMoE(arch.moe, arch.hidden_size, arch.mlp_bias, reduce=tp)
        else:
            self.mixer = NemotronMLP(
                arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.mlp_bias, reduce=tp
            )

    def forward(
        self, x: torch.Tensor, pending: PendingResidual | None, batch: ForwardBatch, ropes: RopeMemo
    ) -> tuple[torch.Tensor, PendingResidual]:
        """The hidden state (the previous block's ``pending`` add summed in by ``norm``) and this
        block's residual add, left to the next norm. ``ropes`` is unused: Nemotron-H's attention
        has no position embedding."""
        x, h = self.norm.enter(x, pending)
        if self.kind == "mamba":
            h = self.mixer(h, batch)
        elif self.kind == "full_attention":
            h = self.mixer(h, batch, None)
        else:
            h = self.mixer(h)
        return x, PendingResidual(h)


class NemotronHBackbone(nn.Module):
    """HF's ``backbone.*`` weights: embeddings, blocks, final norm."""

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        super().__init__()
        self.embeddings = token_embedding(arch)
        self.layers = nn.ModuleList(NemotronHBlock(arch, i, layer_group[i]) for i in range(arch.num_layers))
        self.norm_f = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The embedding under the name ``LanguageModel`` (and the loader's tying) reads."""
        return self.embeddings

    @property
    def norm(self) -> RMSNorm:
        """The final norm under the name ``LanguageModel`` reads."""
        return self.norm_f


class NemotronHLM(LanguageModel):
    """NemotronHForCausalLM: ``LanguageModel`` over ``NemotronHBlock``s, its stack registered as
    ``backbone`` (the checkpoint's prefix; ``model`` still reaches it, as the runner expects).
    Multi-token-prediction weights (``mtp.*``) are not used, as in HF."""

    STACK_NAME = "backbone"
    IGNORED_WEIGHT_PREFIXES = ("mtp.",)

    def __init__(self, arch: ModelArch, layer_group: tuple[int, ...]):
        super().__init__(arch, NemotronHBackbone(arch, layer_group))
