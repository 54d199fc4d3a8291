"""Reading Hugging Face config fields the same way for every model family's builder.

Rotary parameters (``_rope``, with YaRN in ``_yarn``), eos ids, ``layer_types`` checks, the
fields every ``ModelArch`` shares (``_shared_fields``) and HF's serialised floats (``_float``).
Used by ``arch_from_hf_config`` and the per-family builders (``bamba_arch``, ``hybrid_arch``,
``qwen3_gpt_oss_arch``, ``qwen3_next_arch``).
"""

from __future__ import annotations

import math
from typing import Any

from engine.model.arch.model_arch import RopeArch, UnsupportedModelError, YarnArch


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
    return {
        "vocab_size": int(config["vocab_size"]),
        "hidden_size": int(config["hidden_size"]),
        "intermediate_size": int(config["intermediate_size"]),
        "num_heads": heads,
        "num_kv_heads": int(config.get("num_key_value_heads", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(config.get("rms_norm_eps", eps)),
        "max_position_embeddings": int(config.get("max_position_embeddings", max_positions)),
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_ids": _eos(config),
    }


def _float(value: Any) -> float:
    if isinstance(value, dict) and "__float__" in value:  # HF serialises inf as {"__float__": "Infinity"}
        return float(value["__float__"])
    return float(value)
