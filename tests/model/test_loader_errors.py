"""Bad checkpoints get errors that name the path and the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.model.arch.hf_config import SUPPORTED_ARCHITECTURES, arch_from_hf_config
from engine.model.arch.model_arch import UnsupportedModelError
from engine.model.checkpoints.loader import CheckpointError, load_hf_directory
from engine.model.checkpoints.tiny import build_tiny_checkpoint


def test_unsupported_architecture_names_it_and_the_supported_list() -> None:
    with pytest.raises(UnsupportedModelError) as info:
        arch_from_hf_config({"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 8})
    assert "GPTNeoXForCausalLM" in str(info.value)
    assert all(name in str(info.value) for name in SUPPORTED_ARCHITECTURES)


def test_missing_config_and_missing_weights(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config.json"):
        load_hf_directory(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
            }
        )
    )
    with pytest.raises(CheckpointError, match=r"no \*.safetensors"):
        load_hf_directory(tmp_path)


def test_corrupt_weights(tmp_path: Path) -> None:
    directory = build_tiny_checkpoint("tiny-llama", tmp_path / "m")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot read weights"):
        load_hf_directory(directory)
