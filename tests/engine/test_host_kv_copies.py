"""The host tier's bytes (``engine.host_kv.HostKVMemory``) on a hybrid layout (tiny-hybrid: an
attention pool and a Mamba state pool): after a step's coalesced copies, every offloaded host
block holds the bytes its device block held before, and every promoted device block the bytes
its host block held before, per pool and slot, with the compiled row copies and with the numpy
fallback. Oracle: the slot tensors cloned before the copies, compared byte for byte. The
same-process reference copies (``time_reference_copies``) move the promotes' bytes and no slot's.
"""

from __future__ import annotations

import random

import pytest
import torch

from configs import load_config
from engine import host_kv
from engine.core import resolve_model_directory
from engine.host_kv import HostKVMemory
from engine.kv_cache.host_tier import HostTier
from engine.model.arch.hf_config import arch_from_hf_config
from engine.model.checkpoints.loader import read_hf_config
from engine.model.kv_layout import KVLayout, build_kv_layout

DEVICE_BLOCKS = 24
HOST_BLOCKS = 40


def hybrid_layout() -> KVLayout:
    config = load_config("tiny-hybrid", [])
    arch = arch_from_hf_config(read_hf_config(resolve_model_directory(config)), config.model.sliding_window_override)
    return build_kv_layout(arch, config.kv_cache.block_size, config.model.resolved_dtype)


def test_the_compiled_row_copies_are_built() -> None:
    assert host_kv.copy_rows is not None, "build it: python setup.py build_ext --inplace"


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_promoted_bytes_are_the_offloaded_bytes_per_pool_and_slot(compiled: bool, monkeypatch) -> None:
    if not compiled:
        monkeypatch.setattr(host_kv, "copy_rows", None)
    layout = hybrid_layout()
    assert [pool.kind for pool in layout.pools] == ["attention", "state"]
    generator = torch.Generator().manual_seed(0)
    slots = [
        torch.randint(0, 256, (DEVICE_BLOCKS, page), dtype=torch.uint8, generator=generator)
        for page in layout.slot_page_bytes
    ]
    memory = HostKVMemory(layout, slots, [HOST_BLOCKS] * layout.num_pools)
    tier = HostTier([HOST_BLOCKS] * layout.num_pools, num_groups=len(layout.groups))
    rng = random.Random(0)
    groups = [layout.groups_in(p)[0] for p in range(layout.num_pools)]

    # step 1: evict blocks 1..8 of each pool to the host
    for p, g in enumerate(groups):
        for d in range(1, 9):
            tier.offload(p, d, g, bytes([p, d]))
    before = [slot.clone() for slot in slots]
    memory.run(tier.take_copies())
    for p, g in enumerate(groups):
        for d in range(1, 9):
            host_id = tier.pools[p].cached[g][bytes([p, d])].block_id
            for s in range(layout.pools[p].num_slots):
                index = layout.slot_index(p, s)
                assert torch.equal(memory.host[index][host_id], before[index][d]), (p, s, d)

    assert memory.memcpy_bytes == 0 and memory.memcpy_seconds == 0.0  # no reference copies asked for
    memory.time_reference_copies()  # from now on each promote batch is followed by a plain copy

    # step 2, an admission under pressure: each promote's fresh device block first evicts its
    # cached contents to another host block, then receives a host block's bytes
    device_before = [slot.clone() for slot in slots]
    host_before = [host.clone() for host in memory.host]
    promoted: list[tuple[int, int, int]] = []  # (pool, device id, host id read)
    evicted: list[tuple[int, int, bytes]] = []
    for p, g in enumerate(groups):
        sources = rng.sample(list(tier.pools[p].cached[g].values()), 5)
        tier.lock(sources)
        for source, d in zip(sources, rng.sample(range(10, DEVICE_BLOCKS), 5), strict=True):
            tier.offload(p, d, g, bytes([p, d, 0xEE]))
            evicted.append((p, d, bytes([p, d, 0xEE])))
            tier.promote(source, d)
            promoted.append((p, d, source.block_id))
        tier.unlock(sources)
    copies = tier.take_copies()
    assert len(copies) == 2 * layout.num_pools  # one batch per pool and direction
    memory.run(copies)
    for p, d, block_hash in evicted:
        host_id = tier.pools[p].cached[groups[p]][block_hash].block_id
        for s in range(layout.pools[p].num_slots):
            index = layout.slot_index(p, s)
            assert torch.equal(memory.host[index][host_id], device_before[index][d]), (p, s, d)
    for p, d, host_id in promoted:
        for s in range(layout.pools[p].num_slots):
            index = layout.slot_index(p, s)
            assert torch.equal(slots[index][d], host_before[index][host_id]), (p, s, d)
    untouched = {(p, d) for p in range(layout.num_pools) for d in range(DEVICE_BLOCKS)} - {
        (p, d) for p, d, _ in promoted
    }
    for p, d in untouched:
        for s in range(layout.pools[p].num_slots):
            index = layout.slot_index(p, s)
            assert torch.equal(slots[index][d], device_before[index][d]), (p, s, d)
    moved = sum(memory.block_bytes(p) for p, _, _ in promoted)
    assert memory.bytes_to_device == moved
    # the reference copies moved the promotes' bytes (and, checked above, touched no slot)
    assert memory.memcpy_bytes == moved and memory.memcpy_seconds > 0.0


def test_the_compiled_row_copies_check_every_index_before_copying() -> None:
    copy_rows = host_kv.copy_rows
    assert copy_rows is not None
    target = torch.zeros(4, 16, dtype=torch.uint8).numpy()
    source = torch.arange(6 * 16, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(6, 16).numpy()
    with pytest.raises(IndexError, match="source_rows"):
        copy_rows([target], [source], [0, 1], [2, 6])
    with pytest.raises(IndexError, match="target_rows"):
        copy_rows([target], [source], [4, 1], [2, 3])
    assert not target.any()  # nothing copied
    with pytest.raises(ValueError, match="rows of"):
        copy_rows([target], [source[:, :8].copy()], [0], [0])
    with pytest.raises(ValueError, match="not C-contiguous"):
        copy_rows([target], [source[:, :16:2]], [0], [0])
    copy_rows([target], [source], [3, 0], [1, 5])
    assert (target[3] == source[1]).all() and (target[0] == source[5]).all() and not target[1:3].any()
