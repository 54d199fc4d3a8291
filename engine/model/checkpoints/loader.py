"""Load checkpoints: Hugging Face directories (config.json + safetensors) and tiny random models.

Every failure names the path and what is wrong with it (missing config, no weights, missing or
unexpected tensors, shape mismatches).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.arch.model_arch import ModelArch
from engine.model.families.bamba import BambaLM
from engine.model.families.decoder import CausalLM
from engine.model.families.granite_hybrid import GraniteHybridLM
from engine.model.families.language_model import LanguageModel
from engine.model.families.nemotron_h import NemotronHLM
from engine.model.families.qwen3_next import Qwen3NextLM
from engine.model.layers.attention import Attention
from engine.model.layers.blocks import GatedMLP
from engine.model.layers.parallel import shard_weights

#: ``ModelArch.family`` -> the class that builds it, from the arch and each layer's KV-cache group
MODEL_CLASSES: dict[str, Callable[[ModelArch, tuple[int, ...]], LanguageModel]] = {
    "llama": CausalLM,
    "gemma3": CausalLM,
    "bamba": BambaLM,
    "qwen3_next": Qwen3NextLM,
    "granite_hybrid": GraniteHybridLM,
    "nemotron_h": NemotronHLM,
}

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the path and the problem."""


def read_hf_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for corrupt files
            raise CheckpointError(f"{file}: cannot read weights ({exc})") from None
    return tensors


def build_model(
    arch: ModelArch,
    layer_group: tuple[int, ...],
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    source: str,
    full_kv_heads: int | None = None,
) -> LanguageModel:
    """Instantiate the model and copy ``weights`` in by name, checking names and shapes. A
    rank-local ``arch`` (``tp_size`` > 1, ``engine.model.layers.parallel.shard_arch``) takes its
    part of each tensor; ``full_kv_heads``: the checkpoint's KV heads (default ``arch``'s)."""
    if arch.tp_size > 1:
        weights = shard_weights(weights, arch, full_kv_heads or arch.num_kv_heads)
    with torch.device("meta"):
        model = MODEL_CLASSES[arch.family](arch, layer_group)
    model = model.to_empty(device=device).to(dtype)
    expected = model.state_dict()
    weights = {k.removeprefix("language_model."): v for k, v in weights.items()}
    ignored = model.IGNORED_WEIGHT_PREFIXES  # e.g. Qwen3-Next's unused "mtp." head
    if ignored:
        weights = {k: v for k, v in weights.items() if not k.startswith(ignored)}
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: weights do not match {arch.architecture} "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})"
        )
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights, strict=False)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # q/k/v and gate/up as one matmul each (weights concatenated once)
        if isinstance(module, (Attention, GatedMLP)):
            module.fuse_projections()
    # Rotary buffers are not in checkpoints; recompute them on the target device.
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and attn.rotary is not None:
            inv_freq = attn.rope_key.inv_freq(arch.head_dim)
            attn.rotary.inv_freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)
    model.eval()
    return model


def load_hf_directory(
    path: str | Path, sliding_window_override: int | None = None
) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """Architecture and raw weights of a Hugging Face model directory."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    arch = arch_from_hf_config(read_hf_config(directory), sliding_window_override)
    return arch, read_safetensors(directory)
