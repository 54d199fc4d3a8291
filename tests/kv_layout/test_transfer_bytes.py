"""A transfer moves exactly the bytes of the blocks it names, each at its own pool's page size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.transfer import TransferError, make_transfer
from engine.transfer.nixl import _block_descs, _slot_indices
from engine.transfer.pairs import as_pool_pairs

# pool 0: 3 attention slots of 512-byte pages; pool 1: 2 state slots of 3000-byte pages
PAGES = [512, 512, 512, 3000, 3000]
SLOT_POOL = [0, 0, 0, 1, 1]
OWNER_ROWS, READER_ROWS = (40, 9), (30, 7)


def rows_of(per_pool: tuple[int, int]) -> list[int]:
    return [per_pool[p] for p in SLOT_POOL]


@pytest.fixture
def pair():
    owner = make_transfer("local", "owner", role="owner", read_timeout_s=5.0)
    reader = make_transfer("local", "reader", role="reader", read_timeout_s=5.0)
    src = owner.allocate_slots(rows_of(OWNER_ROWS), PAGES)
    dst = reader.allocate_slots(rows_of(READER_ROWS), PAGES)
    g = torch.Generator().manual_seed(1)
    for t in [*src, *dst]:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    info = owner.register(src, SLOT_POOL)
    reader.register(dst, SLOT_POOL)
    yield owner, reader, info, src, dst
    reader.close()
    owner.close()


def test_agent_info_names_pools_rows_and_block_bytes(pair) -> None:
    _, reader, info, _, _ = pair
    assert info.pool_blocks == OWNER_ROWS and reader.agent_info.pool_blocks == READER_ROWS
    assert info.pool_block_bytes == (3 * 512, 2 * 3000) and info.num_blocks == OWNER_ROWS[0]


def test_read_copies_exactly_the_named_rows_of_the_named_pools(pair) -> None:
    owner, reader, info, src, dst = pair
    triples = [(0, 39, 0), (0, 5, 29), (1, 8, 6), (1, 0, 0), (0, 6, 6)]  # local 0 and 6 in both pools
    before = [t.clone() for t in dst]
    tid = reader.start_read(info, triples, notify=b"r")
    assert reader.wait(tid) == "done" and owner.owner_notifications() == [b"r"]
    record = reader.read_record(tid)
    assert record.num_blocks == 5 and record.nbytes == 3 * (3 * 512) + 2 * (2 * 3000)
    for s, (d, b) in enumerate(zip(dst, before, strict=True)):
        expect = b.clone()
        for pool, remote, local in triples:
            if SLOT_POOL[s] == pool:
                expect[local] = src[s][remote]
        assert torch.equal(d, expect), f"slot {s}"


def test_pairs_mean_pool_zero_and_bad_triples_are_caller_errors(pair) -> None:
    _, reader, info, src, dst = pair
    tid = reader.start_read(info, [(3, 2)])
    assert reader.wait(tid) == "done"
    assert all(torch.equal(dst[s][2], src[s][3]) for s in range(3))
    for bad in ([(1, 9, 0)], [(1, 0, 7)], [(2, 0, 0)], [(0, 1, 3), (0, 2, 3)]):  # rows out of pool 1, pool 2, twice
        with pytest.raises(ValueError):
            reader.start_read(info, bad)
    pool, _, local = as_pool_pairs([(0, 1, 3), (1, 1, 3)], OWNER_ROWS, READER_ROWS)  # same id, two pools: fine
    assert pool.tolist() == [0, 1] and local.tolist() == [3, 3]


def test_peers_must_agree_on_pools(pair) -> None:
    _, _, info, _, _ = pair
    other = make_transfer("local", "other", role="reader")
    try:
        other.register(other.allocate_slots([30, 30, 7, 7, 7], PAGES), [0, 0, 1, 1, 1])
        with pytest.raises(TransferError, match="same KV layout"):
            other.add_peer(info)
    finally:
        other.close()


def test_nixl_descriptors_address_exactly_the_named_rows() -> None:
    """NIXL reads descriptor lists: the descriptors a read names on each side are the named
    rows of the named pool's slots, in the same order, with that pool's page size."""
    from engine.transfer.records import AgentInfo

    bases = [1 << 20, 2 << 20, 3 << 20, 4 << 20, 8 << 20]

    def info(rows: tuple[int, int]) -> AgentInfo:
        return AgentInfo(
            "nixl",
            "x",
            rows[0],
            tuple(PAGES),
            "h",
            1,
            base_addrs=tuple(bases),
            slot_pool=tuple(SLOT_POOL),
            slot_blocks=tuple(rows_of(rows)),
        )

    owner, reader = info(OWNER_ROWS), info(READER_ROWS)
    lengths = []
    pool, remote, local = as_pool_pairs([(0, 39, 0), (1, 8, 6), (0, 5, 29)], OWNER_ROWS, READER_ROWS)
    for side, ids in ((owner, remote), (reader, local)):
        descs = _block_descs(side.base_addrs, side.page_bytes, [side.rows_of(s) for s in range(5)], 0)
        named = descs[_slot_indices(side, pool, ids)]
        expect = [
            (bases[s] + b * PAGES[s], PAGES[s])
            for s in range(5)
            for p, b in zip(pool.tolist(), ids.tolist(), strict=True)
            if SLOT_POOL[s] == p
        ]
        assert [(int(a), int(n)) for a, n, _ in named] == expect
        assert int(named[:, 1].sum()) == 2 * (3 * 512) + 2 * 3000
        lengths.append(named[:, 1])
    assert np.array_equal(*lengths)  # descriptor i on both sides: one page of one slot
