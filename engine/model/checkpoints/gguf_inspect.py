"""Reading a GGUF file without converting it: its header and tensor table, its sha256.

``inspect_gguf`` checks the file is complete and its architecture one kvfleet implements
(``GGUF_ARCHITECTURES``); ``require_conversion_dependencies`` names the pip packages a conversion
still needs; ``sha256_file`` hashes a file with a progress bar.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.model.checkpoints.gguf_errors import (
    GGUFFileError,
    ModelPackageMissingError,
    UnsupportedGGUFArchitectureError,
)

# GGUF ``general.architecture`` values kvfleet implements, with the Hugging Face class each
# becomes. llama.cpp also stores Mistral as "llama"; transformers then picks MistralForCausalLM by
# the model's name, and the converted config.json is the authority on which class it is.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


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
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError, IndexError, struct errors... for bad files
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
