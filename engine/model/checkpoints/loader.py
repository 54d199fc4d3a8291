"""Load checkpoints: Hugging Face directories (config.json + safetensors) and tiny random models.

Every failure names the path and what is wrong with it (missing config, no weights, missing or
unexpected tensors, shape mismatches). A directory's tensors are read on demand
(``SafetensorsCheckpoint``): a tensor-parallel rank reads only its part of each tensor through
safetensors' slices, so its weight bytes are about 1/N of the model's
(engine/model/layers/parallel.py says which part).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.arch.model_arch import ModelArch
from engine.model.families.bamba import BambaLM
from engine.model.families.decoder import CausalLM
from engine.model.families.granite_hybrid import GraniteHybridLM
from engine.model.families.language_model import LanguageModel
from engine.model.families.nemotron_h import NemotronHLM
from engine.model.families.qwen3_next import Qwen3NextLM
from engine.model.layers.attention import Attention
from engine.model.layers.blocks import GatedMLP
from engine.model.layers.parallel import Cut, weight_cut

#: ``ModelArch.family`` -> the class that builds it, from the arch and each layer's KV-cache group
MODEL_CLASSES: dict[str, Callable[[ModelArch, tuple[int, ...]], LanguageModel]] = {
    "llama": CausalLM,
    "gemma3": CausalLM,
    "bamba": BambaLM,
    "qwen3_next": Qwen3NextLM,
    "granite_hybrid": GraniteHybridLM,
    "nemotron_h": NemotronHLM,
}

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the path and the problem."""


def read_hf_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None


class SafetensorsCheckpoint(MutableMapping[str, torch.Tensor]):
    """The tensors of a directory's ``*.safetensors`` files, read when asked for: ``[name]`` reads
    a whole tensor, ``read(name, cut)`` only a tensor-parallel rank's part of it (safetensors'
    ``get_slice``: the other bytes are never copied out of the file). Tensors set by name are kept
    in memory and take precedence.

    Owns the open files (memory-mapped by safetensors) and ``bytes_read``, the bytes of every
    tensor it has produced. Invariant: each name is in exactly one file (a later file's tensor of
    the same name wins, as when files are merged in name order).
    """

    def __init__(self, files: list[Path]):
        self._files: dict[str, Path] = {}
        self._handles: dict[str, object] = {}  # name -> its open file (safetensors' safe_open object)
        self._set: dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
                names = list(handle.keys())
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types for corrupt files
                raise CheckpointError(f"{file}: cannot read weights ({exc})") from None
            for name in names:
                self._files[name], self._handles[name] = file, handle

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name, None)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._set[name] = tensor

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self._set.pop(name, None)
        self._files.pop(name, None)
        self._handles.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        yield from self._files.keys() - self._set.keys()
        yield from self._set

    def __len__(self) -> int:
        return len(self._files.keys() | self._set.keys())

    def __contains__(self, name: object) -> bool:
        return name in self._set or name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape, read from the file's header."""
        if name in self._set:
            return tuple(self._set[name].shape)
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, cut: Cut | None) -> torch.Tensor:
        """Tensor ``name`` whole (``cut`` None) or only ``cut``'s part of it, read by slice."""
        if name in self._set:
            return self._set[name] if cut is None else cut.apply(self._set[name])
        try:
            part = self._slice(name)
            if cut is None:
                tensor = part[:]
            elif cut.zero:
                tensor = torch.zeros(part.get_shape(), dtype=part[0:0].dtype)
            else:
                lead = (slice(None),) * cut.dim
                pieces = [part[(*lead, slice(start, start + count))] for start, count in cut.ranges]
                tensor = torch.cat(pieces, cut.dim) if len(pieces) > 1 else pieces[0]
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for corrupt files
            raise CheckpointError(f"{self._files[name]}: cannot read weights ({name}: {exc})") from None
        if cut is None or not cut.zero:  # a zero cut reads nothing
            self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _slice(self, name: str):  # safetensors' slice type is not exported
        return self._handles[name].get_slice(name)  # type: ignore[attr-defined]


def read_safetensors(path: Path) -> SafetensorsCheckpoint:
    """The tensors of ``path``'s safetensors files, read on demand (``SafetensorsCheckpoint``)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    return SafetensorsCheckpoint(files)


def _rank_tensors(
    weights: Mapping[str, torch.Tensor], names: dict[str, str], arch: ModelArch, full_kv_heads: int
) -> dict[str, torch.Tensor]:
    """Per model name, the tensor of checkpoint name ``names[name]``: this rank's part under tensor
    parallelism (``weight_cut``), read by slice from a ``SafetensorsCheckpoint``."""
    out: dict[str, torch.Tensor] = {}
    for name, source in names.items():
        if isinstance(weights, SafetensorsCheckpoint):
            cut = weight_cut(source, weights.shape(source), arch, full_kv_heads) if arch.tp_size > 1 else None
            out[name] = weights.read(source, cut)
            continue
        tensor = weights[source]
        cut = weight_cut(source, tensor.shape, arch, full_kv_heads) if arch.tp_size > 1 else None
        out[name] = tensor if cut is None else cut.apply(tensor)
    return out


def build_model(
    arch: ModelArch,
    layer_group: tuple[int, ...],
    weights: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    source: str,
    full_kv_heads: int | None = None,
) -> LanguageModel:
    """Instantiate the model and copy ``weights`` in by name, checking names and shapes. A
    rank-local ``arch`` (``tp_size`` > 1, ``engine.model.layers.parallel.shard_arch``) takes its
    part of each tensor, read by slice from a ``SafetensorsCheckpoint`` (only the tensors the model
    uses are read); ``full_kv_heads``: the checkpoint's KV heads (default ``arch``'s)."""
    with torch.device("meta"):
        model = MODEL_CLASSES[arch.family](arch, layer_group)
    model = model.to_empty(device=device).to(dtype)
    expected = model.state_dict()
    names = {k.removeprefix("language_model."): k for k in weights}  # model name -> checkpoint name
    ignored = model.IGNORED_WEIGHT_PREFIXES  # e.g. Qwen3-Next's unused "mtp." head
    if ignored:
        names = {k: v for k, v in names.items() if not k.startswith(ignored)}
    if arch.tie_word_embeddings:
        names.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(names))
    unexpected = sorted(set(names) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: weights do not match {arch.architecture} "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})"
        )
    weights = _rank_tensors(weights, names, arch, full_kv_heads or arch.num_kv_heads)
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights, strict=False)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # q/k/v and gate/up as one matmul each (weights concatenated once)
        if isinstance(module, (Attention, GatedMLP)):
            module.fuse_projections()
    # Rotary buffers are not in checkpoints; recompute them on the target device.
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and attn.rotary is not None:
            inv_freq = attn.rope_key.inv_freq(arch.head_dim)
            attn.rotary.inv_freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)
    model.eval()
    return model


def load_hf_directory(
    path: str | Path, sliding_window_override: int | None = None
) -> tuple[ModelArch, SafetensorsCheckpoint]:
    """Architecture and raw weights (read on demand) of a Hugging Face model directory."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    arch = arch_from_hf_config(read_hf_config(directory), sliding_window_override)
    return arch, read_safetensors(directory)
