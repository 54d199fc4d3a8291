"""The models of ``benchmarks/hybrid_capacity.py``: their published shapes and vLLM's block for them.

Owns the benchmark's constants (``GIB``, kvfleet's ``BLOCK`` size and the KV ``DTYPE``), the
shapes of Bamba-9B, Granite-4.0-H-Small and Nemotron-H-8B (``MODELS``, Hugging Face config
classes, no weights), their ``ModelArch`` (``model_arch``) and layer counts (``count``), and
vLLM's attention block size per model, asked of vLLM's own code in the anchor venv
(``vllm_shape``, ``ask_vllm``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.arch.model_arch import ModelArch

GIB = 2**30
BLOCK = 16
DTYPE = "bfloat16"
ROOT = Path(__file__).resolve().parents[2]

#: published shapes (config.json of each checkpoint); only what the KV layout depends on matters
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bamba-9b": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(  # noqa: C408
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            attn_layer_indices=[9, 18, 27],
            mamba_n_heads=128,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=128,
            mamba_d_conv=4,
            mamba_expand=2,
        ),
    ),
    "granite-4.0-h-small": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(  # noqa: C408
            vocab_size=100352,
            hidden_size=4096,
            intermediate_size=768,
            shared_intermediate_size=1536,
            num_hidden_layers=40,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=72,
            num_experts_per_tok=10,
            mamba_n_heads=128,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=128,
            mamba_d_conv=4,
            mamba_expand=2,
            tie_word_embeddings=True,
            layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
        ),
    ),
    "nemotron-h-8b": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(  # noqa: C408
            vocab_size=131072,
            hidden_size=4096,
            intermediate_size=21504,
            num_hidden_layers=52,
            hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            mamba_num_heads=128,
            mamba_head_dim=64,
            n_groups=8,
            ssm_state_size=128,
            conv_kernel=4,
            expand=2,
        ),
    ),
}


def model_arch(name: str) -> ModelArch:
    import transformers

    config_class, architecture, shape = MODELS[name]
    config = getattr(transformers, config_class)(**shape)
    return arch_from_hf_config({**config.to_dict(), "architectures": [architecture]})


def count(arch: ModelArch, kinds: tuple[str, ...]) -> int:
    return sum(layer.kind in kinds for layer in arch.layers)


def vllm_shape(name: str, arch: ModelArch) -> dict[str, Any]:
    m = arch.mamba
    assert m is not None
    return {
        "name": name,
        "num_kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": m.intermediate_size,
        "n_groups": m.n_groups,
        "num_heads": m.num_heads,
        "mamba_head_dim": m.head_dim,
        "d_state": m.d_state,
        "d_conv": m.d_conv,
    }


def ask_vllm(shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's attention block size per model, from its own code in the anchor venv."""
    venv = Path(os.environ.get("VLLM_ANCHOR_VENV", Path.home() / ".cache" / "kvfleet-anchors" / "vllm-venv"))
    python = venv / "bin" / "python"
    if not python.exists():
        anchor = ROOT.parent / "shared" / "bench" / "vllm_kv_anchor" / "install.sh"
        raise SystemExit(f"vLLM anchor venv missing at {venv}: run bash {anchor}")
    out = subprocess.run(
        [str(python), "-m", "benchmarks.vllm_hybrid_block"],
        input=json.dumps(shapes),
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
