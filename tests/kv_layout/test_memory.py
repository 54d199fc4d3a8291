"""A recurrent state never shares memory with an attention page: checked on the storage the
layers actually bind (a real tiny Bamba engine), by address ranges and by writing."""

from __future__ import annotations

import pytest
import torch

from configs.load import load_config
from engine.core import EngineCore
from engine.model.families.decoder import Attention
from engine.model.layers.recurrent import RecurrentMixer, cache_users


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses a (strided) view can touch."""
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def bound_views(user: torch.nn.Module) -> list[torch.Tensor]:
    """The cache tensors a layer holds (tensor attributes that are not parameters or buffers)."""
    return [v for v in vars(user).values() if isinstance(v, torch.Tensor)]


@pytest.fixture(scope="module", params=[None, "local"])
def engine(request, tmp_path_factory):
    """tiny Bamba (2 Mamba2 + 2 attention layers), slots from torch or from the local transfer's
    shared memory, pools of different row counts (a memory budget)."""
    config = load_config(
        "tiny-hybrid",
        [
            f"model.weights_cache_dir={tmp_path_factory.mktemp('w')}",
            "kv_cache.num_blocks=null",
            "kv_cache.memory_budget_mib=2",
            "kv_cache.pinning.budget_blocks=null",
        ],
    )
    core = EngineCore(config, threads=1, kv_role="both" if request.param else None)
    yield core
    core.close()


def test_state_views_and_attention_views_live_in_disjoint_pool_slots(engine: EngineCore) -> None:
    layout, slots = engine.layout, engine.runner.slots
    assert len(set(engine.info.pool_blocks)) == 2  # the two pools really differ in rows
    ranges = [byte_range(s) for s in slots]
    for i, a in enumerate(ranges):
        for b in ranges[i + 1 :]:
            assert not overlaps(a, b)
    kinds = {"attention": [], "state": []}
    for index, layer in enumerate(engine.runner.model.model.layers):
        for user in cache_users(layer):
            kind = "state" if isinstance(user, RecurrentMixer) else "attention"
            assert isinstance(user, (Attention, RecurrentMixer))
            slot = layout.slot_index(layout.layer_pool[index], layout.layer_slot[index])
            assert layout.pools[layout.layer_pool[index]].kind == kind
            views = bound_views(user)
            assert views, f"layer {index}: no bound cache"
            for view in views:
                r = byte_range(view)
                assert ranges[slot][0] <= r[0] and r[1] <= ranges[slot][1], f"layer {index} outside its slot"
                kinds[kind].append(r)
    assert kinds["attention"] and kinds["state"]
    for a in kinds["attention"]:
        assert not any(overlaps(a, s) for s in kinds["state"])


def test_writing_every_state_leaves_every_attention_page_untouched(engine: EngineCore) -> None:
    users = [u for layer in engine.runner.model.model.layers for u in cache_users(layer)]
    attention = [v for u in users if isinstance(u, Attention) for v in bound_views(u)]
    states = [v for u in users if isinstance(u, RecurrentMixer) for v in bound_views(u)]
    for v in attention:
        v.fill_(0)
    for v in states:
        v.fill_(7.0)
    assert all(not v.any() for v in attention)
    for v in attention:
        v.fill_(3)
    assert all(bool((v == 7.0).all()) for v in states)
