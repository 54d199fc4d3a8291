"""Random GraniteMoeHybrid (Granite-4.0-H) and Nemotron-H checkpoints built offline through
transformers: the logits oracles and the ``tiny-granite-h`` / ``tiny-nemotron-h`` model sources (the
benchmark-sized models lay their sizes over these recipes: benchmarks/support/bench_checkpoints.py).

``build_hybrid_checkpoint(name, directory, seed, **overrides)`` writes a Hugging Face directory
(config.json + safetensors) that both transformers and kvfleet load. Every parameter (and the
MoE score-correction buffer) that Hugging Face initialises to a constant (norm weights, biases,
``D``, ``dt_bias``) gets random values, and the scalar multipliers are set away from 1, so they
are really exercised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model.checkpoints.random_checkpoint import (
    TINY_BASE,
    unknown_model,
    write_random_checkpoint,
)

_GRANITE: dict[str, Any] = {
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "attention"],
    "intermediate_size": 32,  # per expert
    "shared_intermediate_size": 96,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "mamba_n_heads": 8,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
    "mamba_proj_bias": True,
    "time_step_limit": (0.01, 3.0),
    "position_embedding_type": "nope",  # as Granite-4.0-H ships
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.6,
    "attention_multiplier": 0.3,
    "logits_scaling": 1.5,
}

_NEMOTRON: dict[str, Any] = {
    "hybrid_override_pattern": "M*-EM*",
    "head_dim": 16,
    "intermediate_size": 96,
    "mlp_bias": True,
    "use_bias": True,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 16,
    "time_step_min": 0.05,  # Nemotron-H clamps the step from below here
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
    "moe_latent_size": 48,
    "routed_scaling_factor": 1.7,
}

# name -> (config class, model class, config fields over TINY_BASE)
HYBRID_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-granite-h": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", _GRANITE),
    "tiny-nemotron-h": ("NemotronHConfig", "NemotronHForCausalLM", _NEMOTRON),
}


def _randomise_score_correction(model: Any) -> None:
    """Nemotron-H's MoE score-correction bias is a buffer HF initialises to zeros."""
    import torch

    for buffer_name, buffer in model.named_buffers():
        if buffer_name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn_like(buffer) * 0.2)


def build_hybrid_checkpoint(name: str, directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Create (or overwrite) the random checkpoint ``name`` in ``directory``."""
    if name not in HYBRID_MODELS:
        raise unknown_model("random", name, HYBRID_MODELS)
    config_cls, model_cls, extra = HYBRID_MODELS[name]
    fields = {**TINY_BASE, **extra, **overrides}
    return write_random_checkpoint(config_cls, model_cls, fields, directory, seed, finish=_randomise_score_correction)
