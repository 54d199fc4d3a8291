"""``kv_cache.gpu_memory_utilization``: the KV budget is the GPU's allowed share less what is in
use and the activation reserve (engine/model/gpu_memory.py), split into pools like a fixed budget.
The device query is replaced by known numbers here; tests/engine/test_export_race.py's GPU
module builds a real engine from it on CUDA."""

from __future__ import annotations

import pytest
import torch

from configs import load_config
from engine.model import gpu_memory
from engine.model.kv_budget import blocks_per_pool, split_budget
from engine.model.kv_layout import build_kv_layout
from tests.kv_layout.shapes import bamba_9b

GIB = 2**30


def fake_device(monkeypatch: pytest.MonkeyPatch, free: int, total: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))


def test_budget_is_the_allowed_share_less_what_is_used_and_the_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device(monkeypatch, free=70 * GIB, total=80 * GIB)  # 10 GiB in use (weights, context)
    budget = gpu_memory.gpu_kv_budget_bytes(torch.device("cuda"), 0.9, reserve_bytes=2 * GIB)
    assert budget == int(0.9 * 80 * GIB) - 10 * GIB - 2 * GIB


def test_no_room_left_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device(monkeypatch, free=10 * GIB, total=80 * GIB)
    with pytest.raises(ValueError, match=r"kv_cache.gpu_memory_utilization: 0.5 of 80.0 GiB leaves no KV memory"):
        gpu_memory.gpu_kv_budget_bytes(torch.device("cuda"), 0.5, reserve_bytes=GIB)


def test_the_gpu_budget_is_split_like_a_fixed_one() -> None:
    arch = bamba_9b()
    layout = build_kv_layout(arch, 16, "bfloat16")
    config = load_config(
        "tiny", ["kv_cache.num_blocks=null", "kv_cache.gpu_memory_utilization=0.9", "model.device=cuda"]
    )
    budget = 40 * GIB
    expected = split_budget(layout, budget, 8, config.kv_cache.state_cache_fraction, None).num_blocks
    assert blocks_per_pool(layout, config.kv_cache, 8, budget) == expected
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        blocks_per_pool(layout, config.kv_cache, 8, None)


def test_activation_reserve_grows_with_the_batch_and_the_vocabulary() -> None:
    arch = bamba_9b()
    small = gpu_memory.activation_reserve_bytes(arch, 512, 8, 2)
    assert gpu_memory.activation_reserve_bytes(arch, 4096, 8, 2) > small
    assert gpu_memory.activation_reserve_bytes(arch, 512, 64, 2) - small == 2 * 56 * arch.vocab_size * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sizes the cache from the GPU's free memory)")
def test_a_cuda_engine_sizes_its_cache_from_the_gpu() -> None:
    """A real engine on the GPU: its pools fit in what ``gpu_memory_utilization`` allows beyond
    the memory already in use, and it generates."""
    from engine.core import EngineCore
    from engine.sampling_params import SamplingParams

    free, total = torch.cuda.mem_get_info()
    share = (total - free + 512 * 2**20) / total  # what is in use now plus 512 MiB: a small cache
    config = load_config(
        "tiny-hybrid", ["model.device=cuda", "kv_cache.num_blocks=null", f"kv_cache.gpu_memory_utilization={share:.6f}"]
    )
    engine = EngineCore(config)
    allowed = int(share * total) - (total - free)  # upper bound: before the weights were loaded
    kv_bytes = engine.worker_view.capacity()["bytes"]
    assert 0 < kv_bytes <= allowed
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    tokens = []
    while engine.has_work:
        for out in engine.step():
            tokens += out.new_token_ids
    assert len(tokens) == 4
