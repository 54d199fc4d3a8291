"""The shared sparse MoE block equals Hugging Face's MoE MLPs, loaded by checkpoint names.

Each case saves a one-layer HF model with save_pretrained (so weight names are the checkpoint's,
not HF's in-memory ones), loads that layer's MoE weights into ``SparseMoE`` by name, and compares
outputs on random tokens with the HF module's forward (fp32, atol 1e-5). Router weights and biases
HF would initialise as constants get random values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.model.arch.model_arch import MoEArch
from engine.model.layers.moe import FusedGatedMLP, SparseMoE

HIDDEN = 32
COMMON = {
    "vocab_size": 64,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "initializer_range": 0.2,
}


def _saved_layer(model, directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory)
    weights = load_file(str(directory / "model.safetensors"))
    return {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}


def _randomise_constants(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "bias" in name or "router" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.5)


CASES = {
    # name: (config class, model class, config extras, MoEArch, HF block path, our prefix)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "intermediate_size": 24,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
        },
        MoEArch(6, 2, 16, "qwen", "softmax_topk", norm_topk_prob=True),
        "mlp",
    ),
    "qwen3_moe_unnormalised": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "intermediate_size": 24,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "norm_topk_prob": False,
        },
        MoEArch(6, 3, 16, "qwen", "softmax_topk", norm_topk_prob=False),
        "mlp",
    ),
    "qwen3_next_shared_gate": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "intermediate_size": 24,
            "num_experts": 5,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 20,
            "norm_topk_prob": True,
            "layer_types": ["full_attention"],
            "head_dim": 16,
        },
        MoEArch(
            5, 2, 16, "qwen", "softmax_topk", norm_topk_prob=True, shared_intermediate_size=20, shared_expert_gate=True
        ),
        "mlp",
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "intermediate_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "swiglu_limit": 1.5,
        },
        MoEArch(4, 2, 16, "gpt_oss", "topk_softmax", router_bias=True, swiglu_alpha=1.702, swiglu_limit=1.5),
        "mlp",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_moe_matches_hf(case: str, tmp_path: Path) -> None:
    import transformers

    config_cls, model_cls, extra, moe, path = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    hf_block = model.model.layers[0].get_submodule(path)
    _randomise_constants(hf_block)
    weights = _saved_layer(model, tmp_path, f"model.layers.0.{path}.")
    ours = SparseMoE(moe, HIDDEN)
    assert set(weights) == set(ours.state_dict()), "parameter names differ from the checkpoint's"
    ours.load_state_dict(weights)
    x = torch.randn(1, 37, HIDDEN)
    with torch.no_grad():
        expected = hf_block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = ours(x[0])
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)


def test_granite_layout_and_shared_mlp_match_hf(tmp_path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.GraniteMoeHybridConfig(
        **COMMON,
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=24,
        layer_types=["attention"],
        mamba_n_heads=8,
        mamba_d_head=8,
    )
    model = transformers.GraniteMoeHybridForCausalLM(config).eval()
    layer = model.model.layers[0]
    _randomise_constants(layer.block_sparse_moe)
    weights = _saved_layer(model, tmp_path, "model.layers.0.")
    moe = SparseMoE(MoEArch(4, 2, 16, "granite", "topk_softmax"), HIDDEN)
    shared = FusedGatedMLP(HIDDEN, 24, "silu")
    moe_weights = {
        k.removeprefix("block_sparse_moe."): v for k, v in weights.items() if k.startswith("block_sparse_moe.")
    }
    shared_weights = {k.removeprefix("shared_mlp."): v for k, v in weights.items() if k.startswith("shared_mlp.")}
    assert set(moe_weights) == set(moe.state_dict()) and set(shared_weights) == set(shared.state_dict())
    moe.load_state_dict(moe_weights)
    shared.load_state_dict(shared_weights)
    x = torch.randn(1, 29, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(moe(x[0]), layer.block_sparse_moe(x)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(shared(x[0]), layer.shared_mlp(x)[0], atol=1e-5, rtol=1e-5)


def test_dispatch_equals_a_dense_per_token_reference() -> None:
    """Every token's output is the weighted sum of exactly its top-k experts' outputs."""
    torch.manual_seed(1)
    moe = SparseMoE(MoEArch(8, 3, 12, "qwen", "softmax_topk", norm_topk_prob=True), 16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(23, 16)
    with torch.no_grad():
        weights, experts = moe.route(x)
        assert all(len(set(row.tolist())) == 3 for row in experts)
        torch.testing.assert_close(weights.sum(-1), torch.ones(23))
        dense = torch.stack([moe.experts[e](x) for e in range(8)], dim=1)  # [T, E, H]
        expected = (dense.gather(1, experts[:, :, None].expand(-1, -1, 16)) * weights[:, :, None]).sum(1)
        torch.testing.assert_close(moe(x), expected, atol=1e-6, rtol=1e-6)


def test_bad_moe_options_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"moe.layout"):
        SparseMoE(MoEArch(4, 2, 8, "mixtral"), 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"moe.top_k"):
        SparseMoE(MoEArch(4, 5, 8, "qwen"), 8)
