"""Writing random Hugging Face checkpoints through transformers (offline, seconds): the one rule
the tiny model builders (tiny.py, qwen3_gpt_oss_tiny.py, hybrid_tiny.py, qwen3_next_tiny.py)
share.

Owns the sizes every tiny checkpoint starts from (``TINY_BASE``), seeding, the randomisation of
the parameters HF initialises to a constant, and saving. Invariant: for a given (classes, fields,
seed) the saved tensors are the same on every run, so presets and oracles built from a seed agree.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# vocab 256, hidden 64, 4 query / 2 KV heads; initializer_range 0.1 so logits are not near-ties
TINY_BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.1,
}


def randomise_constant_parameters(model: Any, scale: float = 0.2) -> int:
    """Give every parameter whose entries are all equal (HF's ones/zeros inits) random values
    around that constant; returns how many parameters changed."""
    import torch

    changed = 0
    with torch.no_grad():
        for param in model.parameters():
            flat = param.reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                param.add_(torch.randn_like(param) * scale)
                changed += 1
    return changed


def write_random_checkpoint(
    config_cls: str,
    model_cls: str,
    fields: dict[str, Any],
    directory: str | Path,
    seed: int,
    randomise_constants: bool = True,
    finish: Callable[[Any], None] | None = None,
) -> Path:
    """Build transformers' ``model_cls`` from ``config_cls(**fields)`` under ``torch.manual_seed(seed)``,
    optionally randomise its constant parameters then run ``finish(model)`` (under no_grad), and
    save it (config.json + safetensors) into ``directory``, created or overwritten."""
    import torch
    import transformers

    config = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    if randomise_constants:
        randomise_constant_parameters(model)
    if finish is not None:
        with torch.no_grad():
            finish(model)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def unknown_model(kind: str, name: str, known: dict[str, Any]) -> ValueError:
    """The error a builder raises for a name outside its table."""
    return ValueError(f"model: unknown {kind} model {name!r} (known: {', '.join(sorted(known))})")
