"""engine.model.checkpoints.gguf's cache of converted directories: the marker, the atomic rebuild of an
incomplete or stale directory, the lock that makes concurrent callers convert once, and the
default cache directory. Fast: a tiny GGUF (gguf_files.py), conversion replaced by FakeConvert.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engine.model.checkpoints import gguf as g
from tests.model.gguf_files import FakeConvert, _leftovers

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


@pytest.mark.parametrize(
    "damage", ["no-marker", "marker-garbage", "wrong-sha", "old-format", "truncated-file", "missing-file"]
)
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
        except BaseException as exc:  # noqa: BLE001 - any failure of a thread is reported below
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
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import fcntl, sys, time
            f = open({str(lock)!r}, "a+")
            fcntl.flock(f, fcntl.LOCK_EX)
            print("locked", flush=True)
            time.sleep(1.5)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
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
