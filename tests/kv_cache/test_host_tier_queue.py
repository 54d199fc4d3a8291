"""The host tier's copy queue (``HostTier._queue`` through ``offload`` / ``promote``): a step's
copies coalesce into phases of one offload and one promote batch per pool, and running the
batches (each one reading all its sources, then writing its targets) leaves every device and host
block holding what running the copies one by one, in the order queued, would.

Oracle: a content model updated copy by copy as each ``offload`` / ``promote`` call is made
(what the copies mean), against ``ContentModel.run`` of the batches ``take_copies`` hands out.
"""

from __future__ import annotations

import random

import pytest

from engine.kv_cache.host_tier import HostTier
from tests.kv_cache.test_host_tier import ContentModel

DEVICE_BLOCKS = 8
HOST_BLOCKS = 6  # null block included: 5 usable, so offloads reuse host blocks a promote reads


def fresh_contents() -> tuple[ContentModel, ContentModel]:
    """(batched, sequential) models, every block holding its own marker."""
    models = ContentModel(), ContentModel()
    for model in models:
        for p in range(2):
            model.device.update({(p, d): ("device", p, d) for d in range(1, DEVICE_BLOCKS)})
            model.host.update({(p, h): ("host", p, h) for h in range(1, HOST_BLOCKS)})
    return models


def offload(tier: HostTier, sequential: ContentModel, pool: int, device_id: int, block_hash: bytes) -> None:
    before = tier.counters.offloaded
    tier.offload(pool, device_id, pool, block_hash)  # group g lives in pool g
    if tier.counters.offloaded > before:  # a copy was queued (else the hash was there already)
        host_id = tier.pools[pool].cached[pool][block_hash].block_id
        sequential.host[(pool, host_id)] = sequential.device[(pool, device_id)]


def promote(tier: HostTier, sequential: ContentModel, pool: int, device_id: int, rng: random.Random) -> None:
    cached = list(tier.pools[pool].cached[pool].values())
    if cached:
        block = rng.choice(cached)
        tier.promote(block, device_id)
        sequential.device[(pool, device_id)] = sequential.host[(pool, block.block_id)]


def test_an_admissions_evict_then_promote_pairs_become_one_batch_each_way_per_pool() -> None:
    tier = HostTier([HOST_BLOCKS, HOST_BLOCKS], num_groups=2)
    batched, sequential = fresh_contents()
    for p in range(2):
        for i in range(2):  # two host blocks cached per pool, to promote
            offload(tier, sequential, p, 1 + i, bytes([p, i]))
    batched.run(tier.take_copies())
    rng = random.Random(0)
    for p in range(2):
        for d in (3, 4):  # the fresh device block a promote fills is the one just evicted
            offload(tier, sequential, p, d, bytes([p, d, 9]))
            promote(tier, sequential, p, d, rng)
    copies = tier.take_copies()
    assert [(c.pool, c.to_host, len(c.device_ids)) for c in copies] == [
        (0, True, 2),
        (1, True, 2),
        (0, False, 2),
        (1, False, 2),
    ]
    batched.run(copies)
    assert batched.device == sequential.device
    assert batched.host == sequential.host


def test_an_offload_that_overwrites_a_host_block_a_queued_promote_reads_starts_a_new_phase() -> None:
    tier = HostTier([3], num_groups=1)  # two usable host blocks
    batched, sequential = ContentModel(), ContentModel()
    for model in (batched, sequential):
        model.device.update({(0, d): ("device", d) for d in range(1, DEVICE_BLOCKS)})
    offload(tier, sequential, 0, 1, b"a")
    offload(tier, sequential, 0, 2, b"b")
    batched.run(tier.take_copies())
    a = tier.pools[0].cached[0][b"a"]
    tier.promote(a, 5)  # reads host block of "a" ...
    sequential.device[(0, 5)] = sequential.host[(0, a.block_id)]
    offload(tier, sequential, 0, 3, b"c")  # ... which, least recently used, "c" now overwrites
    copies = tier.take_copies()
    assert [c.to_host for c in copies] == [False, True]
    batched.run(copies)
    assert batched.device[(0, 5)] == ("device", 1)
    assert batched.device == sequential.device and batched.host == sequential.host


@pytest.mark.parametrize("seed", range(30))
def test_random_copy_sequences_batched_equal_copied_one_by_one(seed: int) -> None:
    rng = random.Random(seed)
    tier = HostTier([HOST_BLOCKS, HOST_BLOCKS], num_groups=2)
    batched, sequential = fresh_contents()
    hashes = [bytes([i]) for i in range(12)]
    for step in range(40):
        for _ in range(rng.randrange(1, 12)):
            pool, device_id = rng.randrange(2), rng.randrange(1, DEVICE_BLOCKS)
            if rng.random() < 0.5:
                offload(tier, sequential, pool, device_id, rng.choice(hashes))
            else:
                promote(tier, sequential, pool, device_id, rng)
        copies = tier.take_copies()
        for copy in copies:
            targets = copy.host_ids if copy.to_host else copy.device_ids
            assert len(set(targets)) == len(targets), copy
        batched.run(copies)
        assert batched.device == sequential.device, step
        assert batched.host == sequential.host, step
        for model in (batched, sequential):  # the step's forward writes a block
            model.device[(step % 2, 1 + step % (DEVICE_BLOCKS - 1))] = ("computed", step)
