"""Random Qwen3, Qwen3-MoE and gpt-oss checkpoints built offline through transformers (tests, benchmarks).

``build_random_checkpoint(name, directory, seed, **overrides)`` writes a Hugging Face directory
(config.json + safetensors) that both transformers and kvfleet load. Every parameter Hugging Face
initialises to a constant (RMS norm weights, biases, gpt-oss's expert biases) gets random values,
so norms and biases are really exercised by the logits oracles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model.checkpoints.random_checkpoint import (
    TINY_BASE,
    unknown_model,
    write_random_checkpoint,
)

_COMMON: dict[str, Any] = {**TINY_BASE, "head_dim": 16}

# name -> (config class, model class, config fields over _COMMON)
RANDOM_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_hidden_layers": 3, "intermediate_size": 128}),
    "tiny-qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "tiny-gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_hidden_layers": 4,
            "intermediate_size": 48,
            "num_local_experts": 6,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
            "swiglu_limit": 1.0,  # low enough that the clamps bind on random weights
            # YaRN whose ramp falls inside the 8 rotary frequencies of a 16-wide head
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 64,
                "truncate": False,
            },
        },
    ),
}


def build_random_checkpoint(name: str, directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Create (or overwrite) the random checkpoint ``name`` in ``directory``."""
    if name not in RANDOM_MODELS:
        raise unknown_model("random", name, RANDOM_MODELS)
    config_cls, model_cls, extra = RANDOM_MODELS[name]
    return write_random_checkpoint(config_cls, model_cls, {**_COMMON, **extra, **overrides}, directory, seed)
