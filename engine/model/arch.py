"""The model's shape, adapted once from a Hugging Face ``config.json`` (a plain dict).

Layers downstream take explicit numbers from ``ModelArch``; nothing else reads HF configs.
An unsupported architecture gets an error naming it and the supported list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Gemma3ForCausalLM",
    "BambaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "Qwen3NextForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "NemotronHForCausalLM",
)

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
    """A sparse mixture-of-experts MLP (see engine/model/moe.py for the block).

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
    # nemotron layout (engine/model/nemotron_h.py), scoring "sigmoid_grouped": sigmoid scores plus a
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

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def recurrent_state_floats(self) -> int:
        """fp32 values in one request's state for one recurrent layer (0 without recurrent layers)."""
        if self.gated_deltanet is not None:
            return self.gated_deltanet.state_floats
        return self.mamba.state_floats if self.mamba is not None else 0


def _rope(params: dict[str, Any] | None, default_theta: float, max_positions: int | None = None) -> RopeArch:
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", default_theta))
    if rope_type == "default":
        return RopeArch(theta)
    if rope_type == "linear":
        return RopeArch(theta, float(params["factor"]))
    if rope_type == "yarn":
        return RopeArch(theta, yarn=_yarn(params, max_positions))
    raise UnsupportedModelError(f"rope_parameters.rope_type: {rope_type!r} is not supported (default, linear, yarn)")


def _yarn(params: dict[str, Any], max_positions: int | None) -> YarnArch:
    """YaRN as Hugging Face's ``rope_type: yarn`` defines it (attention factor from ``factor`` and
    optional ``mscale`` / ``mscale_all_dim`` unless given)."""
    if "original_max_position_embeddings" not in params:
        raise UnsupportedModelError("rope_parameters.original_max_position_embeddings: required by rope_type 'yarn'")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        if max_positions is None:
            raise UnsupportedModelError("rope_parameters.factor: required by rope_type 'yarn'")
        factor = max_positions / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return YarnArch(
        factor=factor,
        original_max_positions=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _eos(config: dict[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _checked_layer_types(layer_types: list[str], num_layers: int, allowed: tuple[str, ...]) -> list[str]:
    """``layer_types`` if it has one entry per layer, each one of ``allowed``; else the error naming it."""
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"layer_types: {len(layer_types)} entries for num_hidden_layers={num_layers}")
    for kind in layer_types:
        if kind not in allowed:
            raise UnsupportedModelError(f"layer_types: {kind!r} is not supported here ({', '.join(allowed)})")
    return layer_types


def _shared_fields(config: dict[str, Any], heads: int, head_dim: int, eps: float, max_positions: int) -> dict[str, Any]:
    """Fields every architecture reads the same way from its HF config."""
    return dict(
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", eps)),
        max_position_embeddings=int(config.get("max_position_embeddings", max_positions)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos(config),
    )


def arch_from_hf_config(config: dict[str, Any], sliding_window_override: int | None = None) -> ModelArch:
    """Build a ModelArch from a Hugging Face config dict (``config.json`` contents)."""
    architectures = config.get("architectures") or []
    architecture = architectures[0] if architectures else _guess_architecture(config)
    quantization = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "<unnamed>") if isinstance(quantization, dict) else quantization
        raise UnsupportedModelError(
            f"quantization_config.quant_method: {method!r} is not supported (kvfleet loads unquantized "
            f"float32/bfloat16/float16 safetensors only)"
        )
    if architecture not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported (supported: {supported})")
    if config.get("text_config"):
        config = {**config["text_config"], "architectures": [architecture]}
    if architecture in ("GraniteMoeHybridForCausalLM", "NemotronHForCausalLM"):
        from engine.model.hybrid_arch import granite_hybrid_arch, nemotron_h_arch  # imports this module

        hybrid = granite_hybrid_arch if architecture == "GraniteMoeHybridForCausalLM" else nemotron_h_arch
        return hybrid(config, architecture)
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    num_layers = int(config["num_hidden_layers"])
    window = sliding_window_override or config.get("sliding_window")
    rope_params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    default_theta = float(config.get("rope_theta", 10000.0))

    if architecture == "Gemma3ForCausalLM":
        layer_types = config.get("layer_types") or [
            "full_attention" if (i + 1) % int(config.get("sliding_window_pattern", 6)) == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
        per_type = {
            "sliding_attention": _rope(
                rope_params.get("sliding_attention"), float(config.get("rope_local_base_freq", 10000.0))
            ),
            "full_attention": _rope(rope_params.get("full_attention"), default_theta),
        }
        layers = tuple(
            LayerArch(kind, int(window) if kind == "sliding_attention" else None, per_type[kind])  # type: ignore[arg-type]
            for kind in layer_types
        )
        return ModelArch(
            architecture=architecture,
            family="gemma3",
            **_shared_fields(config, heads, head_dim, 1e-6, 32768),
            layers=layers,
            hidden_act=str(config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            attention_bias=bool(config.get("attention_bias", False)),
            output_bias=bool(config.get("attention_bias", False)),
            attn_scale=float(config.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            embed_scale=math.sqrt(hidden),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
        )

    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"):
        from engine.model import qwen3_gpt_oss_arch as adapters  # imports this module

        adapter = {"Qwen3ForCausalLM": adapters.qwen3_arch, "Qwen3MoeForCausalLM": adapters.qwen3_moe_arch,
                   "GptOssForCausalLM": adapters.gpt_oss_arch}[architecture]
        return adapter(config, architecture, head_dim, window)
    if architecture == "Qwen3NextForCausalLM":
        from engine.model.qwen3_next_arch import qwen3_next_arch  # imports this module

        return qwen3_next_arch(config, architecture, head_dim)
    rope = _rope(rope_params if "rope_type" in rope_params or "type" in rope_params else None, default_theta)
    if architecture == "BambaForCausalLM":
        return _bamba(config, architecture, hidden, heads, head_dim, num_layers, rope_params, default_theta)
    if architecture == "MistralForCausalLM" and window:
        layer_types = ["sliding_attention"] * num_layers
    elif architecture == "Qwen2ForCausalLM" and config.get("use_sliding_window") and window:
        max_window_layers = int(config.get("max_window_layers", num_layers))
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= max_window_layers else "full_attention" for i in range(num_layers)
        ]
    else:
        layer_types = ["full_attention"] * num_layers
    layers = tuple(
        LayerArch(kind, int(window) if kind == "sliding_attention" else None, rope)  # type: ignore[arg-type]
        for kind in layer_types
    )
    return ModelArch(
        architecture=architecture,
        family="llama",
        **_shared_fields(config, heads, head_dim, 1e-6, 4096),
        layers=layers,
        hidden_act=str(config.get("hidden_act", "silu")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", architecture == "Qwen2ForCausalLM")),
        output_bias=architecture != "Qwen2ForCausalLM" and bool(config.get("attention_bias", False)),
        attn_scale=head_dim**-0.5,
    )


def _float(value: Any) -> float:
    if isinstance(value, dict) and "__float__" in value:  # HF serialises inf as {"__float__": "Infinity"}
        return float(value["__float__"])
    return float(value)


def _bamba(
    config: dict[str, Any],
    architecture: str,
    hidden: int,
    heads: int,
    head_dim: int,
    num_layers: int,
    rope_params: dict[str, Any],
    default_theta: float,
) -> ModelArch:
    attention_layers = set(config.get("attn_layer_indices") or [])
    rope = _rope(rope_params, default_theta)
    factor = float(rope_params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    rope = RopeArch(rope.theta, rope.linear_factor, int(head_dim * factor))
    layers = tuple(
        LayerArch("full_attention", None, rope) if i in attention_layers else LayerArch("mamba")
        for i in range(num_layers)
    )
    expand = int(config.get("mamba_expand", 2))
    n_heads = int(config["mamba_n_heads"])
    d_head = config.get("mamba_d_head", "auto")
    intermediate = expand * hidden
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    mamba = MambaArch(
        num_heads=n_heads,
        head_dim=intermediate // n_heads if d_head in (None, "auto") else int(d_head),
        n_groups=int(config.get("mamba_n_groups", 1)),
        d_state=int(config["mamba_d_state"]),
        d_conv=int(config.get("mamba_d_conv", 4)),
        intermediate_size=intermediate,
        conv_bias=bool(config.get("mamba_conv_bias", True)),
        proj_bias=bool(config.get("mamba_proj_bias", False)),
        time_step_min=_float(limit[0]),
        time_step_max=_float(limit[1]),
    )
    return ModelArch(
        architecture=architecture,
        family="bamba",
        **_shared_fields(config, heads, head_dim, 1e-5, 4096),
        layers=layers,
        hidden_act=str(config.get("hidden_act", "silu")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        output_bias=bool(config.get("attention_bias", False)),
        attn_scale=head_dim**-0.5,
        mlp_bias=bool(config.get("mlp_bias", False)),
        mamba=mamba,
    )


def _guess_architecture(config: dict[str, Any]) -> str:
    model_type = config.get("model_type", "")
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
        "bamba": "BambaForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "gpt_oss": "GptOssForCausalLM",
        "granitemoehybrid": "GraniteMoeHybridForCausalLM",
        "nemotron_h": "NemotronHForCausalLM",
        "qwen3_next": "Qwen3NextForCausalLM",
    }.get(model_type, model_type or "<missing architectures>")
