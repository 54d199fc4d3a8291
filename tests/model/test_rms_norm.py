"""RMSNorm (one fused ``F.rms_norm``) against Hugging Face's Llama and Gemma-3 norms, including
after the weight is written in place or replaced (Gemma's cached ``1 + weight`` must follow)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.model.layers.blocks import RMSNorm

DIM, EPS = 48, 1e-6


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_hugging_face_through_weight_changes(gemma: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ours = RMSNorm(DIM, EPS, gemma=gemma).to(dtype)
    theirs = (Gemma3RMSNorm(DIM, eps=EPS) if gemma else LlamaRMSNorm(DIM, eps=EPS)).to(dtype)
    x = torch.randn(5, DIM).to(dtype)
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    for change in ("initial", "written in place", "replaced"):
        new = torch.randn(DIM).to(dtype)
        with torch.no_grad():
            if change == "written in place":
                ours.weight.copy_(new)
            elif change == "replaced":
                ours.weight.data = new.clone()
            theirs.weight.copy_(ours.weight)
            got, want = ours(x), theirs(x)
        assert got.dtype == want.dtype == dtype
        assert (got.float() - want.float()).abs().max().item() <= atol, change
