"""engine.model.checkpoints.gguf's conversion: the checks of a converted config (what kvfleet relies on), and a
tiny GGUF (gguf_files.py) converted for real through transformers into a Hugging Face directory
that loads and gives the GGUF's logits (a few seconds).
"""

from __future__ import annotations

import json

import pytest

from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.checkpoints import gguf as g
from tests.model.gguf_files import _fake_config, write_tiny_gguf

# ---------------------------------------------------------------------------------------------
# Fast: the checks of a converted config


def test_check_converted_config_catches_what_kvfleet_relies_on(tiny_gguf):
    info = g.inspect_gguf(tiny_gguf)
    assert (info.architecture, info.hf_architecture, info.tie_word_embeddings) == ("llama", "LlamaForCausalLM", True)
    g.check_converted_config(_fake_config(), info)
    with pytest.raises(g.GGUFConversionError, match="tie_word_embeddings"):
        g.check_converted_config(_fake_config(tied=False), info)
    with pytest.raises(g.GGUFConversionError, match="architectures"):
        g.check_converted_config({**_fake_config(), "architectures": ["GPT2LMHeadModel"]}, info)
    with pytest.raises(g.GGUFConversionError, match="hidden_size=64, expected 576"):
        g.check_converted_config(_fake_config(), info, g.NAMED_MODELS["smollm2-135m"].expected_config)
    gemma = {
        **_fake_config(),
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "head_dim": 16,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
            "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
        },
    }
    g.check_converted_config(gemma, info)
    with pytest.raises(g.GGUFConversionError, match="layer_types"):
        g.check_converted_config({k: v for k, v in gemma.items() if k != "layer_types"}, info)
    with pytest.raises(g.GGUFConversionError, match=r"rope_parameters.sliding_attention"):
        g.check_converted_config({**gemma, "rope_parameters": {"rope_theta": 1e6}}, info)
    with pytest.raises(g.GGUFConversionError, match="sliding_window"):
        g.check_converted_config({**gemma, "sliding_window": None}, info)


# ---------------------------------------------------------------------------------------------
# Real conversion of a tiny GGUF through transformers (a few seconds)


def test_tiny_gguf_converts_to_a_loadable_hf_directory(tmp_path, tiny_gguf):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    untied = write_tiny_gguf(tmp_path / "tiny-untied.gguf", tied=False, seed=1)
    for source, tied in ((tiny_gguf, True), (untied, False)):
        out = g.ensure_hf_directory(source, tmp_path / "cache")
        names = {p.name for p in out.iterdir()}
        assert {
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            g.MARKER_NAME,
        } <= names
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert "quantization_config" not in config
        assert config["tie_word_embeddings"] is tied
        arch = arch_from_hf_config(config)
        assert (arch.num_layers, arch.hidden_size, arch.num_kv_heads, arch.tie_word_embeddings) == (2, 64, 2, tied)

        tok = transformers.AutoTokenizer.from_pretrained(out)
        assert tok.decode(tok("hello there").input_ids) == "hello there"
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        direct = transformers.AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        ).eval()
        ids = torch.tensor([[1, 5, 200, 257, 3]])
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, direct(ids).logits, rtol=0, atol=1e-6)
