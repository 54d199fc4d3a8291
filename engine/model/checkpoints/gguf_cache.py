"""The converted-model cache on disk: where it lives, its marker file, its lock, atomic replacement.

A converted directory is complete when its marker (``MARKER_NAME``, written last) matches the
GGUF's sha256, ``CONVERSION_FORMAT`` and every file's size. ``_locked`` serialises converters of
one model with ``fcntl.flock``; ``_finish_directory`` flushes the files and writes the marker;
``_remove_stale`` deletes what an interrupted conversion left.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from configs.cache import cache_root

log = logging.getLogger("engine.model.checkpoints.gguf")  # the one logger of the GGUF conversion (gguf.py's)

MARKER_NAME = "kvfleet_conversion.json"
# Bump when the conversion's output changes, so caches made by an older kvfleet are rebuilt.
CONVERSION_FORMAT = 1


def default_cache_dir() -> Path:
    """Converted models live under ``models/`` of the project's cache root (``configs.cache``)."""
    return cache_root() / "models"


def _marker_valid(directory: Path, sha256: str) -> bool:
    """True when ``directory`` holds a complete conversion of the GGUF with this sha256."""
    try:
        marker = json.loads((directory / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("format") != CONVERSION_FORMAT or marker.get("sha256") != sha256:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return False
    for name, size in files.items():
        try:
            if (directory / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _locked(lock_path: Path, what: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_path``; logs when another process holds it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another process is converting it; waiting for %s", what, lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish_directory(directory: Path, marker: dict[str, Any]) -> None:
    """Make the files readable per umask, flush them, then write the marker (last)."""
    umask = os.umask(0)
    os.umask(umask)
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)  # huggingface writes some files 0600 through tempfiles
            _fsync(path)
            files[path.name] = path.stat().st_size
    os.chmod(directory, 0o777 & ~umask)  # mkdtemp makes 0700
    marker = {**marker, "files": files}
    tmp = directory / (MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o666 & ~umask)
    _fsync(tmp)
    os.replace(tmp, directory / MARKER_NAME)
    _fsync(directory)


def _remove_stale(cache_dir: Path, name: str) -> None:
    """Delete temporary directories left by a conversion of ``name`` that died (we hold its lock)."""
    for path in cache_dir.glob(f".{name}.tmp-*"):
        log.info("removing %s, left by an interrupted conversion", path)
        shutil.rmtree(path, ignore_errors=True)
