"""Qwen3, Qwen3-MoE and gpt-oss logits equal Hugging Face transformers' on tiny random checkpoints (fp32).

The cases are tests/model/logits_harness.py's (single prompt; a batch with chunked prefill
crossing gpt-oss's 16-token sliding window; a prefix hit; preempt and resume; bf16 closeness),
run on checkpoints whose HF-constant parameters (norms, biases, sinks, router bias) are random.
Each drives the real scheduler, coordinator and runner and compares every sampled position with
one full HF forward (atol 1e-4).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.checkpoints.loader import read_hf_config
from engine.model.checkpoints.qwen3_gpt_oss_tiny import build_random_checkpoint
from engine.model.kv_layout import build_kv_layout
from tests.model import logits_harness as harness

NAMES = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-gpt-oss"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_gpt_oss")
    return {name: build_random_checkpoint(name, root / name, seed=3) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_single_prompt(name: str, checkpoints, device: str) -> None:
    harness.check_single_prompt(checkpoints[name], device)


@pytest.mark.parametrize("name", NAMES)
def test_batch_with_chunked_prefill_crossing_sliding_windows(name: str, checkpoints, device: str) -> None:
    harness.check_chunked_batch(checkpoints[name], device)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_hit(name: str, checkpoints, device: str) -> None:
    harness.check_prefix_hit(checkpoints[name], device)


@pytest.mark.parametrize("name", NAMES)
def test_preempt_and_resume(name: str, checkpoints, device: str) -> None:
    harness.check_preempt_and_resume(checkpoints[name], device)


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_close_to_fp32(name: str, checkpoints, device: str) -> None:
    harness.check_bfloat16_close(checkpoints[name], device)


def test_checkpoints_really_exercise_the_constants(checkpoints) -> None:
    """Norms, biases, sinks and the router bias are not HF's constant initial values."""
    from safetensors.torch import load_file

    for name in NAMES:
        weights = load_file(str(checkpoints[name] / "model.safetensors"))
        constant = [k for k, v in weights.items() if v.numel() > 1 and bool((v == v.reshape(-1)[0]).all())]
        assert not constant, f"{name}: constant parameters {constant[:5]}"
    gpt_oss = load_file(str(checkpoints["tiny-gpt-oss"] / "model.safetensors"))
    for key in ("self_attn.sinks", "mlp.router.bias", "mlp.experts.down_proj_bias", "self_attn.q_proj.bias"):
        assert f"model.layers.0.{key}" in gpt_oss


def test_gpt_oss_layers_map_onto_sliding_and_full_groups(checkpoints) -> None:
    arch = arch_from_hf_config(read_hf_config(checkpoints["tiny-gpt-oss"]))
    assert [layer.kind for layer in arch.layers] == ["sliding_attention", "full_attention"] * 2
    layout = build_kv_layout(arch, block_size=4, dtype="float32")
    specs = sorted((type(g.spec).__name__, g.layer_names) for g in layout.groups)
    assert specs == [("FullAttentionSpec", ("layers.1", "layers.3")), ("SlidingWindowSpec", ("layers.0", "layers.2"))]
    windows = {g.spec.window for g in layout.groups if isinstance(g.spec, SlidingWindowSpec)}
    assert windows == {16} and any(isinstance(g.spec, FullAttentionSpec) for g in layout.groups)


@pytest.mark.parametrize(
    "params",
    [
        {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },  # gpt-oss's own
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
        },  # truncated
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 1024,
            "mscale": 0.7,
            "mscale_all_dim": 1.0,
        },
    ],
)
def test_yarn_frequencies_and_attention_factor_match_hf(params: dict) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.GptOssConfig(
        num_hidden_layers=2, head_dim=64, max_position_embeddings=131072, rope_parameters=params
    )
    expected_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    raw = {**config.to_dict(), "architectures": ["GptOssForCausalLM"]}
    rope = arch_from_hf_config(raw).layers[0].rope
    assert rope is not None and rope.yarn is not None
    torch.testing.assert_close(torch.tensor(rope.inv_freq(64), dtype=torch.float32), expected_freq, rtol=1e-6, atol=0)
    assert math.isclose(rope.attention_factor, expected_factor, rel_tol=1e-9)
