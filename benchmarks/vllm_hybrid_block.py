"""Ask vLLM 0.33's own code which attention block size it picks for a hybrid Mamba model.

Run under the vLLM anchor venv (../shared/bench/vllm_kv_anchor/install.sh), not the project's:

    ~/.cache/kvfleet-anchors/vllm-venv/bin/python -m benchmarks.vllm_hybrid_block < shapes.json

stdin: a JSON list of shapes ``{"name", "num_kv_heads", "head_dim", "intermediate_size",
"n_groups", "num_heads", "mamba_head_dim", "d_state", "d_conv"}``. For each, this calls vLLM's
``Platform._align_hybrid_block_size`` (the step that inflates the attention block so one
attention page covers a Mamba state) on a minimal config object, with the CUDA FlashAttention
backend's kernel block sizes (``MultipleOf(16)`` on a non-FA4 GPU; the backend class itself
needs CUDA-only imports), block size 16, bf16, prefix caching on (``mamba_cache_mode="align"``).
It does so twice: with vLLM's own Mamba2 state (its shape and dtype calculators: bf16 conv window
of ``d_conv - 1`` columns and bf16 SSM state) and with kvfleet's state (fp32, ``d_conv`` columns).
stdout: one JSON object ``{name: {"vllm_state": {...}, "kvfleet_state": {...}}}`` with the block
size, the attention page of one token and of one block, and the Mamba page before padding.
"""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace
from unittest import mock

import torch

logging.disable(logging.WARNING)


def ask(shape: dict, state: str) -> dict:
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.kv_cache_interface import MambaSpec

    conv_dim = shape["intermediate_size"] + 2 * shape["n_groups"] * shape["d_state"]
    if state == "vllm_state":
        shapes = MambaStateShapeCalculator.mamba2_state_shape(
            1,
            shape["intermediate_size"],
            shape["n_groups"],
            shape["num_heads"],
            shape["mamba_head_dim"],
            shape["d_state"],
            shape["d_conv"],
        )
        dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(torch.bfloat16, "auto", "auto")
    else:
        shapes = ((conv_dim, shape["d_conv"]), (shape["num_heads"], shape["mamba_head_dim"], shape["d_state"]))
        dtypes = (torch.float32, torch.float32)

    class Model:
        @classmethod
        def get_mamba_state_shape_from_config(cls, _config):
            return shapes

        @classmethod
        def get_mamba_state_dtype_from_config(cls, _config):
            return dtypes

    class FlashAttentionKernelSizes:  # CUDA FlashAttentionBackend.get_supported_kernel_block_sizes (non-FA4)
        @staticmethod
        def customize_spec(spec):
            return spec

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return [MultipleOf(16)]

    cache = SimpleNamespace(
        cache_dtype="auto",
        block_size=16,
        mamba_cache_mode="align",
        mamba_page_size_padded=None,
        mamba_block_size=None,
        user_specified_block_size=False,
        kv_cache_dtype_skip_layers=None,
    )
    model = SimpleNamespace(
        dtype=torch.bfloat16,
        use_mla=False,
        architecture="Stub",
        is_hybrid=True,
        get_num_kv_heads=lambda _p: shape["num_kv_heads"],
        get_head_size=lambda: shape["head_dim"],
    )
    config = SimpleNamespace(cache_config=cache, model_config=model, parallel_config=SimpleNamespace())
    with (
        mock.patch.object(ModelRegistry, "resolve_model_cls", lambda *a, **k: (Model, "Stub")),
        mock.patch.object(Platform, "_find_non_ssm_backends", classmethod(lambda cls, c: [FlashAttentionKernelSizes])),
        mock.patch("vllm.config.vllm.set_current_vllm_config", lambda c: mock.MagicMock()),
        mock.patch("vllm.model_executor.layers.mamba.abstract.get_mamba_prefill_checkpoint_alignment", lambda c: None),
    ):
        Platform._align_hybrid_block_size(config, FlashAttentionKernelSizes)
    one_token = 2 * shape["num_kv_heads"] * shape["head_dim"] * 2
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    return {
        "block_size": cache.block_size,
        "attention_page_bytes_1_token": one_token,
        "page_bytes": cache.block_size * one_token,
        "mamba_page_bytes": mamba_page,
        "mamba_page_padded": cache.mamba_page_size_padded,
    }


def main() -> None:
    shapes = json.load(sys.stdin)
    print(json.dumps({s["name"]: {k: ask(s, k) for k in ("vllm_state", "kvfleet_state")} for s in shapes}))


if __name__ == "__main__":
    main()
