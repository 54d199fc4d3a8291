"""Hugging Face config -> ModelArch for the Mamba2 hybrids GraniteMoeHybrid (IBM Granite-4.0-H)
and Nemotron-H (called from ``arch_from_hf_config``).

GraniteMoeHybrid: ``layer_types`` of Mamba2 and attention layers (old name ``layers_block_type``,
``mamba``/``attention`` or the newer ``linear_attention``/``full_attention``); attention with
rotary embeddings only when ``position_embedding_type == "rope"`` (NoPE otherwise), scaled by
``attention_multiplier``; every layer's MLP is a dense ``shared_mlp`` plus, with
``num_local_experts > 0``, a sparse MoE; embeddings, residual branches and logits are scaled by
``embedding_multiplier``, ``residual_multiplier`` and ``1 / logits_scaling``.

Nemotron-H: one mixer per layer after an RMS norm, from ``hybrid_override_pattern`` (``M``
Mamba2, ``*`` attention without position embedding, ``-`` a relu2 MLP, ``E`` a sigmoid-routed MoE
of relu2 experts plus a shared expert) or its newer spelling ``layers_block_type``.
"""

from __future__ import annotations

from typing import Any

from engine.model.arch.hf_config_fields import _float, _rope, _shared_fields
from engine.model.arch.model_arch import (
    LayerArch,
    MambaArch,
    ModelArch,
    MoEArch,
    RopeArch,
    UnsupportedModelError,
)

_GRANITE_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "full_attention",
    "full_attention": "full_attention",
}
_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def granite_hybrid_arch(config: dict[str, Any], architecture: str) -> ModelArch:
    """GraniteMoeHybridForCausalLM (Granite-4.0-H): Mamba2 + attention layers, dense or MoE MLPs."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    num_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * num_layers
    if len(types) != num_layers:
        raise UnsupportedModelError(f"layer_types: {len(types)} entries for num_hidden_layers={num_layers}")
    unknown = sorted({t for t in types if t not in _GRANITE_KINDS})
    if unknown:
        raise UnsupportedModelError(f"layer_types: {unknown} not supported (mamba, attention)")
    rope: RopeArch | None = None
    position = config.get("position_embedding_type")
    if position == "rope":
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope = _rope(params, float(config.get("rope_theta", 10000.0)), config.get("max_position_embeddings"))
    elif position not in (None, "nope"):
        raise UnsupportedModelError(f"position_embedding_type: {position!r} is not supported (rope, nope)")
    layers = tuple(
        LayerArch("full_attention", None, rope) if _GRANITE_KINDS[t] == "full_attention" else LayerArch("mamba")
        for t in types
    )
    expand = int(config.get("mamba_expand", 2))
    n_heads = int(config["mamba_n_heads"])
    d_head = config.get("mamba_d_head", "auto")
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    mamba = MambaArch(
        num_heads=n_heads,
        head_dim=expand * hidden // n_heads if d_head in (None, "auto") else int(d_head),
        n_groups=int(config.get("mamba_n_groups", 1)),
        d_state=int(config["mamba_d_state"]),
        d_conv=int(config.get("mamba_d_conv", 4)),
        intermediate_size=expand * hidden,
        conv_bias=bool(config.get("mamba_conv_bias", True)),
        proj_bias=bool(config.get("mamba_proj_bias", False)),
        time_step_min=_float(limit[0]),
        time_step_max=_float(limit[1]),
    )
    act = str(config.get("hidden_act", "silu"))
    experts = int(config.get("num_local_experts") or 0)
    moe = None
    if experts > 0:
        moe = MoEArch(
            num_experts=experts,
            top_k=int(config.get("num_experts_per_tok", 2)),
            intermediate_size=int(config["intermediate_size"]),
            layout="granite",
            scoring="topk_softmax",
            hidden_act=act,
        )
    bias = bool(config.get("attention_bias", False))
    return ModelArch(
        architecture=architecture,
        family="granite_hybrid",
        **{
            **_shared_fields(config, heads, head_dim, 1e-6, 2048),
            "intermediate_size": int(config.get("shared_intermediate_size", 1024)),
        },
        layers=layers,
        hidden_act=act,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bias,
        output_bias=bias,
        attn_scale=float(config.get("attention_multiplier", 1.0)),
        embed_scale=float(config.get("embedding_multiplier", 1.0)),
        mamba=mamba,
        moe=moe,
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        logits_scaling=float(config.get("logits_scaling", 1.0)),
    )


def _get(config: dict[str, Any], name: str, legacy: str, default: Any) -> Any:
    """Nemotron-H renamed its Mamba fields (``mamba_d_conv`` -> ``conv_kernel`` ...); read either."""
    return config[name] if name in config else config.get(legacy, default)


def _nemotron_types(config: dict[str, Any]) -> list[str]:
    types = config.get("layers_block_type") or config.get("layer_types")
    if types is None:
        pattern = config.get("hybrid_override_pattern")
        if not pattern:
            raise UnsupportedModelError("hybrid_override_pattern: missing (and no layers_block_type)")
        unknown = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if unknown:
            raise UnsupportedModelError(f"hybrid_override_pattern: characters {unknown} not supported (M, *, -, E)")
        return [_NEMOTRON_PATTERN[c] for c in pattern]
    types = ["linear_attention" if t == "mamba" else "full_attention" if t == "attention" else t for t in types]
    unknown = sorted(set(types) - set(_NEMOTRON_PATTERN.values()))
    if unknown:
        raise UnsupportedModelError(f"layers_block_type: {unknown} not supported (mamba, attention, mlp, moe)")
    return types


def nemotron_h_arch(config: dict[str, Any], architecture: str) -> ModelArch:
    """NemotronHForCausalLM: Mamba2, NoPE attention, relu2 MLP and MoE layers."""
    types = _nemotron_types(config)
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config.get("attention_head_dim") or hidden // heads)
    eps = float(config.get("layer_norm_epsilon", 1e-5))
    if str(config.get("mamba_hidden_act", "silu")) != "silu":
        raise UnsupportedModelError(f"mamba_hidden_act: {config['mamba_hidden_act']!r} is not supported (silu)")
    n_heads, d_head = int(config.get("mamba_num_heads", 128)), int(config.get("mamba_head_dim", 64))
    mamba = MambaArch(
        num_heads=n_heads,
        head_dim=d_head,
        n_groups=int(_get(config, "n_groups", "mamba_n_groups", 8)),
        d_state=int(config.get("ssm_state_size", 128)),
        d_conv=int(_get(config, "conv_kernel", "mamba_d_conv", 4)),
        intermediate_size=n_heads * d_head,
        conv_bias=bool(_get(config, "use_conv_bias", "mamba_conv_bias", True)),
        proj_bias=bool(config.get("use_bias", False)),
        # Nemotron-H clamps the step from below at time_step_min (no upper limit)
        time_step_min=_float(_get(config, "time_step_min", "mamba_dt_min", 0.001)),
    )
    act = str(config.get("mlp_hidden_act", "relu2"))
    moe = None
    if "moe" in types:
        latent = config.get("moe_latent_size")
        moe = MoEArch(
            num_experts=int(_get(config, "n_routed_experts", "num_local_experts", 8)),
            top_k=int(config.get("num_experts_per_tok", 2)),
            intermediate_size=int(config["moe_intermediate_size"]),
            layout="nemotron",
            scoring="sigmoid_grouped",
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            hidden_act=act,
            shared_intermediate_size=int(config["moe_shared_expert_intermediate_size"]),
            n_group=int(config.get("n_group", 1)),
            topk_group=int(config.get("topk_group", 1)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            latent_size=int(latent) if latent else 0,
        )
    layers = tuple(
        LayerArch("mamba")
        if t == "linear_attention"
        else LayerArch("full_attention")
        if t == "full_attention"
        else LayerArch("mlp", moe=t == "moe")
        for t in types
    )
    return ModelArch(
        architecture=architecture,
        family="nemotron_h",
        **{**_shared_fields(config, heads, head_dim, eps, 4096), "rms_norm_eps": eps},
        layers=layers,
        hidden_act=act,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=False,
        output_bias=False,
        attn_scale=head_dim**-0.5,
        mlp_bias=bool(config.get("mlp_bias", False)),
        mamba=mamba,
        moe=moe,
    )
