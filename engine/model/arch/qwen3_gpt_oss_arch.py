"""Hugging Face config -> ModelArch for Qwen3, Qwen3-MoE and gpt-oss (from ``arch_from_hf_config``).

Qwen3 is Llama with an RMS norm over each q/k head before rotary; Qwen3-MoE replaces every MLP
with the sparse MoE block (softmax over experts, top-k, optional renormalisation); gpt-oss alternates sliding and
full attention layers, adds q/k/v/o biases and per-head attention sinks, uses YaRN rotary and a
sparse MoE MLP (top-k logits then softmax, router bias, clamped SwiGLU experts).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.model.arch.hf_config_fields import _checked_layer_types, _rope, _shared_fields
from engine.model.arch.model_arch import LayerArch, ModelArch, MoEArch, RopeArch, UnsupportedModelError


def _layers(
    config: dict[str, Any], num_layers: int, default_types: list[str], window: int | None, rope: RopeArch
) -> tuple[LayerArch, ...]:
    """One LayerArch per ``layer_types`` entry (or ``default_types``); sliding layers get ``window``."""
    allowed = ("full_attention", "sliding_attention")
    layer_types = _checked_layer_types(list(config.get("layer_types") or default_types), num_layers, allowed)
    if "sliding_attention" in layer_types and not window:
        raise UnsupportedModelError(f"sliding_window: {window!r}, but layer_types has sliding_attention layers")
    return tuple(
        LayerArch(kind, int(window) if kind == "sliding_attention" else None, rope)  # type: ignore[arg-type]  # kind: a checked LayerKind
        for kind in layer_types
    )


def _rope_for(config: dict[str, Any]) -> RopeArch:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return _rope(params, float(config.get("rope_theta", 10000.0)), config.get("max_position_embeddings"))


def qwen3_arch(config: dict[str, Any], architecture: str, head_dim: int, window: int | None) -> ModelArch:
    num_layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    sliding = bool(config.get("use_sliding_window")) and window
    max_window_layers = int(config.get("max_window_layers", num_layers))
    default_types = [
        "sliding_attention" if sliding and i >= max_window_layers else "full_attention" for i in range(num_layers)
    ]
    bias = bool(config.get("attention_bias", False))
    return ModelArch(
        architecture=architecture,
        family="llama",
        **_shared_fields(config, heads, head_dim, 1e-6, 32768),
        layers=_layers(config, num_layers, default_types, window if sliding else None, _rope_for(config)),
        hidden_act=str(config.get("hidden_act", "silu")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bias,
        output_bias=bias,
        attn_scale=head_dim**-0.5,
        qk_norm=True,
    )


def gpt_oss_arch(config: dict[str, Any], architecture: str, head_dim: int, window: int | None) -> ModelArch:
    num_layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    default_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    moe = MoEArch(
        num_experts=int(config["num_local_experts"]),
        top_k=int(config.get("num_experts_per_tok", config.get("experts_per_token", 4))),
        intermediate_size=int(config["intermediate_size"]),
        layout="gpt_oss",
        scoring="topk_softmax",
        router_bias=True,
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
    )
    bias = bool(config.get("attention_bias", True))
    return ModelArch(
        architecture=architecture,
        family="llama",
        **_shared_fields(config, heads, head_dim, 1e-5, 131072),
        layers=_layers(config, num_layers, default_types, window, _rope_for(config)),
        hidden_act="silu",  # unused: the experts' clamped SwiGLU is fixed by the layout
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bias,
        output_bias=bias,
        attn_scale=head_dim**-0.5,
        moe=moe,
        attention_sinks=True,
    )


def qwen3_moe_arch(config: dict[str, Any], architecture: str, head_dim: int, window: int | None) -> ModelArch:
    """Qwen3 attention with the sparse MoE MLP in every layer (qwen layout, softmax then top-k)."""
    mlp_only = list(config.get("mlp_only_layers") or [])
    if mlp_only:
        raise UnsupportedModelError(f"mlp_only_layers: {mlp_only} is not supported (every layer must be MoE)")
    step = int(config.get("decoder_sparse_step", 1))
    if step != 1:
        raise UnsupportedModelError(f"decoder_sparse_step: {step} is not supported (1: every layer MoE)")
    num_layers = int(config["num_hidden_layers"])
    sliding = bool(config.get("use_sliding_window")) and window
    dense = qwen3_arch({**config, "use_sliding_window": False, "layer_types": None}, architecture, head_dim, None)
    moe = MoEArch(
        num_experts=int(config.get("num_experts", config.get("num_local_experts", 0))),
        top_k=int(config["num_experts_per_tok"]),
        intermediate_size=int(config["moe_intermediate_size"]),
        layout="qwen",
        scoring="softmax_topk",
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        hidden_act=str(config.get("hidden_act", "silu")),
    )
    kind = "sliding_attention" if sliding else "full_attention"
    layers = _layers({}, num_layers, [kind] * num_layers, window if sliding else None, _rope_for(config))
    return replace(dense, layers=layers, moe=moe)
