"""Tiny GGUF files and a stand-in for the conversion, for the engine.model.checkpoints.gguf tests.

``write_tiny_gguf`` writes a valid GGUF with ``gguf.GGUFWriter`` (a 2-layer random Llama with a
byte-level BPE tokenizer, ~370 kB); ``FakeConvert`` replaces ``convert_gguf`` for the cache logic.
The fixtures built on them (``tiny_gguf``, ``fake_convert``) are in conftest.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np

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


def write_tiny_gguf(
    path: Path,
    architecture: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    tied: bool = True,
    seed: int = 0,
) -> Path:
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


def _fake_config(tied: bool = True) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 259,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
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


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if ".tmp-" in p.name)
