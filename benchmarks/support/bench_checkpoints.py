"""The benchmark-sized random checkpoints (8 layers, hidden 512) of the families without a real
checkpoint on PyPI: each is the product's tiny recipe of its family with the sizes below laid over
it (the builders' ``overrides``), so the benchmark models follow the tiny recipes' other fields.
Fields a tiny recipe sets for its own small shape and the benchmark model leaves at transformers'
default (gpt-oss's YaRN and SwiGLU limit, Qwen3-Next's layer pattern) are reset to that default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model.checkpoints.hybrid_tiny import build_hybrid_checkpoint
from engine.model.checkpoints.qwen3_gpt_oss_tiny import build_random_checkpoint
from engine.model.checkpoints.qwen3_next_tiny import build_qwen3_next_checkpoint

QWEN3: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
}

GPT_OSS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
    "num_local_experts": 8,
    "sliding_window": 128,
}

GRANITE_H: dict[str, Any] = {
    "num_hidden_layers": 8,
    "layer_types": ["mamba", "mamba", "mamba", "attention", "mamba", "mamba", "mamba", "attention"],
    "intermediate_size": 256,
    "shared_intermediate_size": 1024,
    "num_local_experts": 8,
    "mamba_n_heads": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 64,
    "mamba_chunk_size": 64,
    "vocab_size": 32000,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
}

NEMOTRON_H: dict[str, Any] = {
    "hybrid_override_pattern": "M-M*M-ME",
    "head_dim": 64,
    "intermediate_size": 1536,
    "mamba_num_heads": 16,
    "mamba_head_dim": 64,
    "ssm_state_size": 64,
    "n_groups": 4,
    "chunk_size": 64,
    "moe_intermediate_size": 256,
    "moe_shared_expert_intermediate_size": 512,
    "moe_latent_size": None,
    "vocab_size": 32000,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
}

# 6 linear + 2 full attention layers (Qwen3-Next's 3:1 pattern: transformers' default layer types)
QWEN3_NEXT: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 512,
    "layer_types": None,
    "mlp_only_layers": None,
}

BENCH_MODELS = ("qwen3", "gpt-oss", "granite-h", "nemotron-h", "qwen3-next")


def _gpt_oss_defaults() -> dict[str, Any]:
    """transformers' own gpt-oss YaRN and SwiGLU limit (the tiny recipe narrows both)."""
    from transformers import GptOssConfig

    defaults = GptOssConfig()
    return {"swiglu_limit": defaults.swiglu_limit, "rope_parameters": defaults.rope_parameters}


def build_bench_checkpoint(name: str, directory: str | Path, seed: int = 0) -> Path:
    """Create (or overwrite) the benchmark-sized checkpoint of family ``name`` in ``directory``."""
    if name == "qwen3":
        return build_random_checkpoint("tiny-qwen3", directory, seed, **QWEN3)
    if name == "gpt-oss":
        return build_random_checkpoint("tiny-gpt-oss", directory, seed, **GPT_OSS, **_gpt_oss_defaults())
    if name == "granite-h":
        return build_hybrid_checkpoint("tiny-granite-h", directory, seed, **GRANITE_H)
    if name == "nemotron-h":
        return build_hybrid_checkpoint("tiny-nemotron-h", directory, seed, **NEMOTRON_H)
    if name == "qwen3-next":
        return build_qwen3_next_checkpoint("tiny-qwen3-next", directory, seed, **QWEN3_NEXT)
    raise ValueError(f"name: no benchmark checkpoint {name!r} (known: {', '.join(BENCH_MODELS)})")
