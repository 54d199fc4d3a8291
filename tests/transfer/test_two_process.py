"""Two OS processes move scattered block rows through each backend; bytes and notifications match."""

from __future__ import annotations

import pytest
import torch

from engine.transfer import make_transfer
from tests.transfer.helpers import LOCAL_BLOCKS, PAGES, REMOTE_BLOCKS, expected_after, fill, scattered_pairs
from tests.transfer.owner_proc import owner_process, source_slots


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["nixl", "local"])
def test_scattered_rows_between_processes(backend: str) -> None:
    with owner_process(backend, REMOTE_BLOCKS, PAGES, seed=1) as owner:
        reader = make_transfer(backend, "reader", role="reader", read_timeout_s=10.0)
        slots = reader.allocate_slots(LOCAL_BLOCKS, PAGES)
        before = fill(slots, seed=2)
        reader.register(slots)
        source = source_slots(REMOTE_BLOCKS, PAGES, seed=1)

        pairs = scattered_pairs(seed=3)
        tid = reader.start_read(owner.info, pairs, notify=b"req-1")
        assert reader.wait(tid) == "done", reader.error(tid)
        assert reader.read_record(tid).num_blocks == len(pairs)
        expected = expected_after(before, source, pairs)
        for got, want in zip(slots, expected, strict=False):
            assert torch.equal(got, want)  # targets hold the source rows, every other row unchanged

        # Same peer again (descriptors prepared once), then a notification-only "read".
        more = [(47, 5), (0, 6), (23, 39)]
        t2 = reader.start_read(owner.info.name, more, notify=b"req-2")
        t3 = reader.start_read(owner.info.name, [], notify=b"req-3")
        assert reader.wait(t2) == "done" and reader.wait(t3) == "done"
        expected = expected_after(expected, source, more)
        for got, want in zip(slots, expected, strict=False):
            assert torch.equal(got, want)
        assert sorted(owner.notifications(expect=3)) == [b"req-1", b"req-2", b"req-3"]
        for t in (tid, t2, t3):
            reader.release(t)
        reader.close()
