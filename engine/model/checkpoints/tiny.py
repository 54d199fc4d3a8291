"""Tiny random checkpoints built through transformers (offline, seconds): the logits oracles.

``build_tiny_checkpoint(name, directory, seed)`` writes a Hugging Face directory that both
transformers and kvfleet load. Sizes are ``COMMON`` plus each model's fields; ``initializer_range`` is
raised to 0.1 so logits are not near-ties.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model.checkpoints.hybrid_tiny import HYBRID_MODELS, build_hybrid_checkpoint
from engine.model.checkpoints.qwen3_next_tiny import QWEN3_NEXT_MODELS, build_qwen3_next_checkpoint
from engine.model.checkpoints.random_checkpoint import (
    TINY_BASE,
    unknown_model,
    write_random_checkpoint,
)

COMMON: dict[str, Any] = {**TINY_BASE, "intermediate_size": 128}

TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-llama": ("LlamaConfig", "LlamaForCausalLM", {"num_hidden_layers": 2}),
    "tiny-qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_hidden_layers": 2}),
    "tiny-mistral": ("MistralConfig", "MistralForCausalLM", {"num_hidden_layers": 2, "sliding_window": 16}),
    "tiny-gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 16,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        },
    ),
    "tiny-bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        {
            "num_hidden_layers": 4,
            "attn_layer_indices": [1, 3],
            "mamba_n_heads": 8,
            "mamba_d_head": "auto",
            "mamba_n_groups": 1,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 16,
        },
    ),
}


def build_tiny_checkpoint(name: str, directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Create (or overwrite) a tiny random checkpoint of ``name`` in ``directory``."""
    if name in HYBRID_MODELS:  # Granite-4.0-H / Nemotron-H, with HF's constant parameters randomised
        return build_hybrid_checkpoint(name, directory, seed, **overrides)
    if name in QWEN3_NEXT_MODELS:  # with HF's constant parameters randomised
        return build_qwen3_next_checkpoint(name, directory, seed, **overrides)
    if name not in TINY:
        raise unknown_model("tiny", name, TINY)
    config_cls, model_cls, extra = TINY[name]
    fields = {**COMMON, **extra, **overrides}
    return write_random_checkpoint(config_cls, model_cls, fields, directory, seed, randomise_constants=False)
