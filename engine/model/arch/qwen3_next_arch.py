"""Hugging Face config -> ModelArch for Qwen3-Next (called from ``arch_from_hf_config``).

Qwen3-Next interleaves Gated DeltaNet layers (``linear_attention``: a recurrent state per
request) with gated full attention layers (an output gate from ``q_proj``, q/k norms, partial
rotary), every norm scaling by ``1 + weight``; the MLP is a sparse MoE with a gated shared expert
except on ``mlp_only_layers`` / off the ``decoder_sparse_step`` grid, where it is dense.
Options kvfleet does not implement are refused here, naming the field, before any weight is read.
"""

from __future__ import annotations

from typing import Any

from engine.model.arch.hf_config_fields import _checked_layer_types, _rope, _shared_fields
from engine.model.arch.model_arch import (
    GatedDeltaNetArch,
    LayerArch,
    ModelArch,
    MoEArch,
    RopeArch,
    UnsupportedModelError,
)

LAYER_KINDS = ("linear_attention", "full_attention")


def _layer_types(config: dict[str, Any], num_layers: int) -> list[str]:
    layer_types = config.get("layer_types")
    if layer_types is None:
        interval = int(config.get("full_attention_interval", 4))
        if interval < 1:
            raise UnsupportedModelError(f"full_attention_interval: {interval} must be >= 1")
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    return _checked_layer_types(list(layer_types), num_layers, LAYER_KINDS)


def _gated_deltanet(config: dict[str, Any]) -> GatedDeltaNetArch:
    gdn = GatedDeltaNetArch(
        num_k_heads=int(config.get("linear_num_key_heads", 16)),
        num_v_heads=int(config.get("linear_num_value_heads", 32)),
        head_k_dim=int(config.get("linear_key_head_dim", 128)),
        head_v_dim=int(config.get("linear_value_head_dim", 128)),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
    )
    if gdn.num_v_heads % gdn.num_k_heads:
        raise UnsupportedModelError(
            f"linear_num_value_heads: {gdn.num_v_heads} is not a multiple of linear_num_key_heads={gdn.num_k_heads}"
        )
    if gdn.conv_kernel < 2:
        raise UnsupportedModelError(f"linear_conv_kernel_dim: {gdn.conv_kernel} must be >= 2")
    return gdn


def _moe(config: dict[str, Any], num_layers: int) -> tuple[MoEArch | None, tuple[int, ...]]:
    """The sparse MoE block and the layers whose MLP is dense instead."""
    num_experts = int(config.get("num_experts", 0))
    if num_experts <= 0:
        return None, ()
    step = int(config.get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step: {step} must be >= 1")
    mlp_only = set(config.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0)
    moe = MoEArch(
        num_experts=num_experts,
        top_k=int(config.get("num_experts_per_tok", 10)),
        intermediate_size=int(config.get("moe_intermediate_size", 512)),
        layout="qwen",
        scoring="softmax_topk",
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        hidden_act=str(config.get("hidden_act", "silu")),
        shared_intermediate_size=int(config.get("shared_expert_intermediate_size", 0)),
        shared_expert_gate=True,
    )
    return moe, dense


def qwen3_next_arch(config: dict[str, Any], architecture: str, head_dim: int) -> ModelArch:
    num_layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    if str(config.get("hidden_act", "silu")) != "silu":
        raise UnsupportedModelError(f"hidden_act: {config.get('hidden_act')!r} is not supported for Qwen3-Next (silu)")
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    base = _rope(params, float(config.get("rope_theta", 10000.0)), config.get("max_position_embeddings"))
    factor = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedModelError(
            f"partial_rotary_factor: {factor} gives rotary dim {rotary_dim} (must be even, > 0)"
        )
    rope = RopeArch(base.theta, base.linear_factor, rotary_dim, base.yarn)
    layers = tuple(
        LayerArch("full_attention", None, rope) if kind == "full_attention" else LayerArch("linear_attention")
        for kind in _layer_types(config, num_layers)
    )
    moe, dense = _moe(config, num_layers)
    bias = bool(config.get("attention_bias", False))
    return ModelArch(
        architecture=architecture,
        family="qwen3_next",
        **_shared_fields(config, heads, head_dim, 1e-6, 32768),
        layers=layers,
        hidden_act="silu",
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bias,
        output_bias=bias,
        attn_scale=head_dim**-0.5,
        qk_norm=True,
        moe=moe,
        gated_deltanet=_gated_deltanet(config),
        dense_mlp_layers=dense,
    )
