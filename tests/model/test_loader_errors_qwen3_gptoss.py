"""Unsupported Qwen3 / gpt-oss checkpoint options get an error naming the field and its value,
raised from config.json alone, before any weight file is opened."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.arch.model_arch import UnsupportedModelError
from engine.model.checkpoints.loader import load_hf_directory


def _gpt_oss_config(**changes) -> dict:
    import transformers

    config = transformers.GptOssConfig(num_hidden_layers=2, num_local_experts=4, head_dim=16).to_dict()
    return {**config, "architectures": ["GptOssForCausalLM"], **changes}


def _directory_with_unreadable_weights(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")  # reading it would fail differently
    return tmp_path


def test_quantized_checkpoint_names_the_quant_method_before_reading_weights(tmp_path: Path) -> None:
    config = _gpt_oss_config(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["router"]})
    with pytest.raises(UnsupportedModelError, match=r"quantization_config\.quant_method: 'mxfp4'"):
        load_hf_directory(_directory_with_unreadable_weights(tmp_path, config))


def test_quantized_qwen3_is_rejected_too() -> None:
    import transformers

    config = {
        **transformers.Qwen3Config(num_hidden_layers=1).to_dict(),
        "architectures": ["Qwen3ForCausalLM"],
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    with pytest.raises(UnsupportedModelError, match=r"quantization_config\.quant_method: 'fp8'"):
        arch_from_hf_config(config)


def test_unsupported_rope_type_names_it(tmp_path: Path) -> None:
    config = _gpt_oss_config(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0]})
    with pytest.raises(UnsupportedModelError, match=r"rope_parameters\.rope_type: 'longrope'"):
        load_hf_directory(_directory_with_unreadable_weights(tmp_path, config))


def test_yarn_without_original_length_names_the_field() -> None:
    config = _gpt_oss_config(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match=r"original_max_position_embeddings"):
        arch_from_hf_config(config)


def test_unknown_layer_type_names_it() -> None:
    config = _gpt_oss_config(layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(UnsupportedModelError, match=r"layer_types: 'chunked_attention'"):
        arch_from_hf_config(config)


def test_sliding_layers_without_a_window_name_sliding_window() -> None:
    config = _gpt_oss_config(sliding_window=None)
    with pytest.raises(UnsupportedModelError, match=r"sliding_window: None"):
        arch_from_hf_config(config)


def test_layer_types_of_the_wrong_length() -> None:
    config = _gpt_oss_config(layer_types=["full_attention"] * 3)
    with pytest.raises(UnsupportedModelError, match=r"layer_types: 3 entries for num_hidden_layers=2"):
        arch_from_hf_config(config)


@pytest.mark.parametrize(("field", "value"), [("mlp_only_layers", [1]), ("decoder_sparse_step", 2)])
def test_qwen3_moe_with_dense_layers_names_the_field(field: str, value) -> None:
    import transformers

    config = {
        **transformers.Qwen3MoeConfig(num_hidden_layers=2).to_dict(),
        "architectures": ["Qwen3MoeForCausalLM"],
        field: value,
    }
    with pytest.raises(UnsupportedModelError, match=re.escape(f"{field}: {value}")):
        arch_from_hf_config(config)
