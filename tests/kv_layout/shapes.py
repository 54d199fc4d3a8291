"""Published shapes of real Mamba hybrids as ModelArch values (no weights), for layout tests."""

from __future__ import annotations

import dataclasses

from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.arch.model_arch import LayerArch, ModelArch

BAMBA_9B = dict(  # noqa: C408
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    attn_layer_indices=[9, 18, 27],
    mamba_n_heads=128,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=128,
    mamba_d_conv=4,
    mamba_expand=2,
)


def bamba_9b() -> ModelArch:
    from transformers import BambaConfig

    config = BambaConfig(**BAMBA_9B)
    return arch_from_hf_config({**config.to_dict(), "architectures": ["BambaForCausalLM"]})


def with_layers(arch: ModelArch, kinds: list[str], window: int = 32) -> ModelArch:
    """``arch`` with its layer list replaced (kinds: full / sliding / mamba / mlp)."""
    names = {"full": "full_attention", "sliding": "sliding_attention", "mamba": "mamba", "mlp": "mlp"}
    layers = tuple(
        LayerArch(names[k], window if k == "sliding" else None, arch.layers[0].rope)
        for k in kinds  # type: ignore[arg-type]
    )
    return dataclasses.replace(arch, layers=layers)
