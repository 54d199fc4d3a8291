"""The model's shape, adapted once from a Hugging Face ``config.json`` (a plain dict).

Layers downstream take explicit numbers from ``ModelArch`` (``engine.model.arch.model_arch``);
nothing else reads HF configs. An unsupported architecture gets an error naming it and the
supported list.

This module owns the entry point, ``arch_from_hf_config``: Llama, Qwen2, Mistral and Gemma3 are
built here, the other families by their adapters in this package (``bamba_arch``, ``hybrid_arch``,
``qwen3_gpt_oss_arch``, ``qwen3_next_arch``), which read fields through ``hf_config_fields`` and
never import this module.
"""

from __future__ import annotations

import math
from typing import Any

from engine.model.arch import qwen3_gpt_oss_arch
from engine.model.arch.bamba_arch import _bamba
from engine.model.arch.hf_config_fields import _rope, _shared_fields
from engine.model.arch.hybrid_arch import granite_hybrid_arch, nemotron_h_arch
from engine.model.arch.model_arch import LayerArch, ModelArch, UnsupportedModelError
from engine.model.arch.qwen3_next_arch import qwen3_next_arch

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
            LayerArch(kind, int(window) if kind == "sliding_attention" else None, per_type[kind])  # type: ignore[arg-type]  # kind: a checked LayerKind
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
        adapter = {
            "Qwen3ForCausalLM": qwen3_gpt_oss_arch.qwen3_arch,
            "Qwen3MoeForCausalLM": qwen3_gpt_oss_arch.qwen3_moe_arch,
            "GptOssForCausalLM": qwen3_gpt_oss_arch.gpt_oss_arch,
        }[architecture]
        return adapter(config, architecture, head_dim, window)
    if architecture == "Qwen3NextForCausalLM":
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
        LayerArch(kind, int(window) if kind == "sliding_attention" else None, rope)  # type: ignore[arg-type]  # kind: a checked LayerKind
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
