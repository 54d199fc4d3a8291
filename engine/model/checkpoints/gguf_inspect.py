"""Reading a GGUF file without converting it: its header and tensor table, its sha256.

``inspect_gguf`` checks the file is complete and its architecture one kvfleet implements
(``GGUF_ARCHITECTURES``); ``require_conversion_dependencies`` names the pip packages a conversion
still needs; ``sha256_file`` hashes a file with a progress bar.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import mmap
import struct
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


@dataclass(frozen=True)
class _TensorEntry:
    name: str
    data_offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class _Header:
    strings: dict[str, str]  # the metadata's string values (arrays left out)
    tensors: list[_TensorEntry]


# GGUF metadata value types (the format's numbering) and the byte size of the fixed-size ones.
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _HeaderCursor:
    """Reads a little-endian GGUF header from a memory map, front to back. Only the metadata's
    strings are kept: arrays (the vocabulary: 262,144 strings for Gemma 3) are stepped over by
    their lengths, where gguf's own reader makes one numpy view per element (about a minute for
    Gemma 3's vocabulary)."""

    def __init__(self, data: mmap.mmap):
        self.data = data
        self.offset = 0

    def unpack(self, fmt: str) -> tuple[int, ...]:
        values: tuple[int, ...] = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        end = self.offset + length
        if end > len(self.data):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        text = self.data[self.offset : end].decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            self.string()
        elif kind == _ARRAY:
            item_kind, count = self.unpack("<IQ")
            if item_kind in _SCALAR_BYTES:
                self.offset += _SCALAR_BYTES[item_kind] * count
            else:
                for _ in range(count):
                    self.skip_value(item_kind)
        elif kind in _SCALAR_BYTES:
            self.offset += _SCALAR_BYTES[kind]
        else:
            raise ValueError(f"unknown metadata value type {kind}")
        if self.offset > len(self.data):
            raise ValueError("the metadata runs past the end of the file")


def _read_header(path: Path) -> _Header:
    """The GGUF's string metadata and tensor table (names, file offsets, byte sizes)."""
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _HeaderCursor(data)
        magic, version = cursor.unpack("<II")
        if magic != GGUF_MAGIC:
            raise ValueError("no GGUF magic at the start of the file")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (kvfleet reads little-endian versions 2 and 3)")
        tensor_count, kv_count = cursor.unpack("<QQ")
        strings: dict[str, str] = {}
        alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(kv_count):
            key = cursor.string()
            (kind,) = cursor.unpack("<I")
            if kind == _STRING:
                strings[key] = cursor.string()
            elif key == "general.alignment" and kind == _UINT32:
                (alignment,) = cursor.unpack("<I")
            else:
                cursor.skip_value(kind)
        table: list[tuple[str, int, int, int]] = []
        for _ in range(tensor_count):
            name = cursor.string()
            (n_dims,) = cursor.unpack("<I")
            elements = math.prod(cursor.unpack(f"<{n_dims}Q"))
            ggml_type, offset = cursor.unpack("<IQ")
            table.append((name, elements, ggml_type, offset))
        start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, elements, ggml_type, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        tensors.append(_TensorEntry(name, start + offset, elements // block * block_bytes))
    return _Header(strings, tensors)


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
    try:
        header = _read_header(path)
    except Exception as exc:  # noqa: BLE001 - struct, mmap, enum and decoding errors all mean a bad file
        raise GGUFFileError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from None
    tensors = header.tensors
    if not tensors:
        raise GGUFFileError(f"{path}: the GGUF file has no tensors")
    end = max(t.data_offset + t.n_bytes for t in tensors)
    if end > size:
        raise GGUFFileError(f"{path}: truncated GGUF file ({size} bytes, its tensors need {end})")
    architecture = header.strings.get("general.architecture", "")
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
        model_name=header.strings.get("general.name", ""),
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
