"""Converting a GGUF with transformers: dequantise to an fp32 Hugging Face directory, then check it.

``convert_gguf`` writes the directory (safetensors, config, tokenizer); ``check_converted_config``
refuses a ``config.json`` that kvfleet's ``arch_from_hf_config`` would read wrongly.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from engine.model.arch.hf_config import SUPPORTED_ARCHITECTURES, arch_from_hf_config
from engine.model.checkpoints.gguf_errors import GGUFConversionError, GGUFFileError
from engine.model.checkpoints.gguf_inspect import GGUFInfo, require_conversion_dependencies

log = logging.getLogger("engine.model.checkpoints.gguf")  # the one logger of the GGUF conversion (gguf.py's)


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Dequantise ``gguf_path`` to fp32 and write a Hugging Face directory into ``out_dir``.

    Returns the written ``config.json`` as a dict. transformers refuses to ``save_pretrained`` a
    model loaded from GGUF ("quantized with gguf, not serializable"), so the weights are copied into
    a clean model built from the same config (without ``quantization_config``), which saves.
    """
    require_conversion_dependencies()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    gguf_path = Path(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    where = {"gguf_file": gguf_path.name, "local_files_only": True}

    # transformers reads the GGUF's metadata in full (every token string) each time it builds a
    # config from it, and by default the tokenizer and the model each build one before the model
    # reads the tensors: three reads of the whole file. Here the config is read once and handed to
    # both, so the file is read twice (the config, then the tensors); the tokenizer's own reader
    # reads only its vocabulary.
    start = time.monotonic()
    log.info("%s: reading the config and loading the tokenizer (about 5-30 s)", gguf_path.name)
    hf_config = AutoConfig.from_pretrained(gguf_path.parent, **where)
    tokenizer_type = hf_config.model_type if hf_config.model_type in TOKENIZER_MAPPING_NAMES else None
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, tokenizer_type=tokenizer_type, **where)
    log.info(
        "%s: config and tokenizer loaded in %.1f s; loading and dequantising the model (about 20-60 s)",
        gguf_path.name,
        time.monotonic() - start,
    )

    start = time.monotonic()
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, config=hf_config, dtype=torch.float32, **where)
    log.info(
        "%s: model loaded in %.1f s (%s, %.1fM parameters)",
        gguf_path.name,
        time.monotonic() - start,
        type(loaded).__name__,
        sum(p.numel() for p in loaded.parameters()) / 1e6,
    )

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
