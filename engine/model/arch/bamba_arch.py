"""Hugging Face config -> ModelArch for Bamba (called from ``arch_from_hf_config``).

Bamba is Mamba2 layers with full attention layers at ``attn_layer_indices`` (partial rotary), a
Llama MLP after each; ``_bamba`` reads the Mamba2 mixer's sizes into ``MambaArch``.
"""

from __future__ import annotations

from typing import Any

from engine.model.arch.hf_config_fields import _float, _rope, _shared_fields
from engine.model.arch.model_arch import LayerArch, MambaArch, ModelArch, RopeArch


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
