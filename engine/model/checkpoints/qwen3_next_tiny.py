"""Random Qwen3-Next checkpoints built offline through transformers (tests, presets, benchmarks).

``build_qwen3_next_checkpoint(name, directory, seed, **overrides)`` writes a Hugging Face
directory (config.json + safetensors). Parameters Hugging Face initialises to a constant (the
zero-centred RMS norms, the gated norm's ones, ``dt_bias``) get random values, so every norm and
gate is really exercised by the logits oracles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model.checkpoints.random_checkpoint import (
    TINY_BASE,
    unknown_model,
    write_random_checkpoint,
)

_BASE: dict[str, Any] = {
    **TINY_BASE,
    "intermediate_size": 96,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}

# name -> config fields over _BASE
QWEN3_NEXT_MODELS: dict[str, dict[str, Any]] = {
    # 2 Gated DeltaNet + 2 gated attention layers; layer 2's MLP is dense, the others are MoE
    "tiny-qwen3-next": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "mlp_only_layers": [2],
    },
}


def build_qwen3_next_checkpoint(name: str, directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Create (or overwrite) the random Qwen3-Next checkpoint ``name`` in ``directory``."""
    if name not in QWEN3_NEXT_MODELS:
        raise unknown_model("Qwen3-Next", name, QWEN3_NEXT_MODELS)
    fields = {**_BASE, **QWEN3_NEXT_MODELS[name], **overrides}
    return write_random_checkpoint("Qwen3NextConfig", "Qwen3NextForCausalLM", fields, directory, seed)
