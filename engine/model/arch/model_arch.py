"""The model's shape as frozen dataclasses: ``ModelArch`` and the parts it is made of.

``ModelArch`` holds every number the torch model needs; ``LayerArch`` one layer's kind, window and
rotary; ``RopeArch`` / ``YarnArch`` the rotary embedding; ``MoEArch``, ``MambaArch`` and
``GatedDeltaNetArch`` the optional mixers. Also the layer kinds (``LayerKind``,
``RECURRENT_KINDS``, ``CACHELESS_KINDS``) and ``UnsupportedModelError``. Nothing here reads a
Hugging Face config; ``engine.model.arch.hf_config`` builds these from one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# "mamba" and "linear_attention" keep a recurrent state per request; "mlp" layers keep no cache.
LayerKind = Literal["full_attention", "sliding_attention", "mamba", "linear_attention", "mlp"]
RECURRENT_KINDS = ("mamba", "linear_attention")
CACHELESS_KINDS = ("mlp",)


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one kvfleet implements."""


@dataclass(frozen=True)
class YarnArch:
    """YaRN context extension: frequencies below the ``beta_slow`` rotation count over
    ``original_max_positions`` are interpolated by ``factor``, those above ``beta_fast`` kept, a
    linear ramp between; cos/sin are scaled by ``attention_factor``."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class RopeArch:
    """Rotary embedding of one layer type: inverse frequencies from theta, optional linear factor
    or YaRN scaling."""

    theta: float
    linear_factor: float = 1.0
    rotary_dim: int = 0  # 0: the whole head
    yarn: YarnArch | None = None

    @property
    def attention_factor(self) -> float:
        """Scale applied to cos and sin (YaRN's attention temperature; 1 otherwise)."""
        return self.yarn.attention_factor if self.yarn else 1.0

    def inv_freq(self, head_dim: int) -> list[float]:
        dim = self.rotary_dim or head_dim
        plain = [1.0 / (self.theta ** (i / dim)) / self.linear_factor for i in range(0, dim, 2)]
        if self.yarn is None:
            return plain
        yarn = self.yarn

        def correction_dim(rotations: float) -> float:
            return dim * math.log(yarn.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
        if yarn.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        out = []
        for i, extrapolated in enumerate(plain):
            keep = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)  # 1: original frequency
            out.append(extrapolated / yarn.factor * (1.0 - keep) + extrapolated * keep)
        return out


@dataclass(frozen=True)
class MoEArch:
    """A sparse mixture-of-experts MLP (see engine/model/layers/moe.py for the block).

    ``layout`` names the checkpoint convention (parameter names and expert math):
    ``"qwen"``: router ``gate``, experts ``experts.{i}.{gate,up,down}_proj`` (Qwen3-MoE, Qwen3-Next);
    ``"gpt_oss"``: router ``router`` (with bias), fused ``experts.gate_up_proj[_bias]`` /
    ``experts.down_proj[_bias]`` with interleaved gate/up and clamped SwiGLU;
    ``"granite"``: router ``router.layer``, fused ``input_linear`` / ``output_linear``.
    ``scoring``: ``"softmax_topk"`` (softmax over all experts, then top-k, optionally renormalised)
    or ``"topk_softmax"`` (top-k logits, softmax over those k).
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    layout: Literal["qwen", "gpt_oss", "granite", "nemotron"]
    scoring: Literal["softmax_topk", "topk_softmax", "sigmoid_grouped"] = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False
    hidden_act: str = "silu"
    swiglu_alpha: float = 1.702  # gpt_oss only
    swiglu_limit: float = 7.0  # gpt_oss only
    shared_intermediate_size: int = 0  # qwen layout: a ``shared_expert`` MLP inside the block (0: none)
    shared_expert_gate: bool = False  # qwen layout: ``sigmoid(shared_expert_gate(x))`` scales the shared expert
    # nemotron layout (engine/model/families/nemotron_h.py), scoring "sigmoid_grouped": sigmoid scores plus a
    # correction bias choose the experts within the best ``topk_group`` of ``n_group`` groups; weights
    # are the plain sigmoid scores (renormalised if ``norm_topk_prob``) times ``routed_scaling_factor``
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    latent_size: int = 0  # nemotron: experts run in a latent space this wide (0: the hidden size)


@dataclass(frozen=True)
class MambaArch:
    """A Mamba2 mixer: heads x head_dim channels, state size, groups, causal conv width."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    intermediate_size: int
    conv_bias: bool
    proj_bias: bool
    time_step_min: float = 0.0
    time_step_max: float = float("inf")
    # tensor parallelism with fewer groups than ranks (engine/model/layers/parallel.py): this
    # rank's one group is group ``group`` of the model's, shared by ``group_ranks`` ranks
    group_ranks: int = 1
    group: int = 0

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @property
    def state_floats(self) -> int:
        """fp32 numbers in one request's state: conv window plus SSM state."""
        return self.conv_dim * self.d_conv + self.num_heads * self.head_dim * self.d_state


@dataclass(frozen=True)
class GatedDeltaNetArch:
    """A Gated DeltaNet mixer (Qwen3-Next's linear attention): ``num_k_heads`` query/key heads of
    ``head_k_dim``, ``num_v_heads`` value heads of ``head_v_dim`` (a multiple of the key heads),
    a depthwise causal conv of width ``conv_kernel`` over the concatenated q, k, v channels."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_floats(self) -> int:
        """fp32 numbers in one request's state: the last ``conv_kernel - 1`` conv inputs plus the
        delta-rule state (``[num_v_heads, head_k_dim, head_v_dim]``)."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_v_heads * self.head_k_dim * self.head_v_dim


@dataclass(frozen=True)
class LayerArch:
    """One decoder layer's mixer: its kind and what that kind needs (window, rope, MoE MLP).

    Invariant: ``window`` is set only on sliding-attention layers; ``rope`` only on attention
    layers (and may be None there: NoPE).
    """

    kind: LayerKind
    window: int | None = None  # sliding window in tokens (query sees keys in (q - window, q])
    rope: RopeArch | None = None  # None on an attention layer: no position embedding (NoPE)
    moe: bool = False  # an "mlp" layer whose MLP is ModelArch.moe (Nemotron-H's "E" layers)


@dataclass(frozen=True)
class ModelArch:
    """Everything the torch model needs to know about one checkpoint's architecture."""

    architecture: str
    family: Literal["llama", "gemma3", "bamba", "qwen3_next", "granite_hybrid", "nemotron_h"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layers: tuple[LayerArch, ...]
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections
    output_bias: bool  # o_proj
    max_position_embeddings: int
    attn_scale: float
    embed_scale: float = 1.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mlp_bias: bool = False
    mamba: MambaArch | None = None
    moe: MoEArch | None = None  # every layer's MLP is this sparse MoE block
    qk_norm: bool = False  # RMS norm over each q/k head before rotary (Qwen3)
    attention_sinks: bool = False  # a learned per-head logit in every softmax denominator (gpt-oss)
    residual_multiplier: float = 1.0  # GraniteMoeHybrid: every residual branch is scaled by this
    logits_scaling: float = 1.0  # GraniteMoeHybrid: logits are divided by this
    gated_deltanet: GatedDeltaNetArch | None = None  # the "linear_attention" layers' mixer (Qwen3-Next)
    dense_mlp_layers: tuple[int, ...] = ()  # layers whose MLP is dense even though ``moe`` is set
    # tensor parallelism (engine/model/layers/parallel.py): this arch is rank ``tp_rank``'s part of ``tp_size``
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def recurrent_state_floats(self) -> int:
        """fp32 values in one request's state for one recurrent layer (0 without recurrent layers)."""
        if self.gated_deltanet is not None:
            return self.gated_deltanet.state_floats
        return self.mamba.state_floats if self.mamba is not None else 0
