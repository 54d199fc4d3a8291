"""Dead, frozen and vanished owners surface as "failed" within the read timeout; the reader
keeps serving other peers afterwards."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from engine.transfer import make_transfer
from tests.transfer.helpers import LOCAL_BLOCKS, PAGES, REMOTE_BLOCKS, expected_after, fill, scattered_pairs
from tests.transfer.owner_proc import owner_process, source_slots

TIMEOUT_S = 1.5


def timed_wait(reader, tid):
    t0 = time.monotonic()
    status = reader.wait(tid, timeout_s=TIMEOUT_S + 5)  # the read's own deadline must end it first
    return status, time.monotonic() - t0


def assert_reads_fine(reader, owner, slots, seed: int) -> None:
    before = [t.clone() for t in slots]
    pairs = scattered_pairs(seed)
    tid = reader.start_read(owner.info, pairs, notify=b"fresh")
    assert reader.wait(tid) == "done", reader.error(tid)
    want = expected_after(before, source_slots(REMOTE_BLOCKS, PAGES, seed=seed), pairs)
    assert all(torch.equal(g, w) for g, w in zip(slots, want, strict=False))
    assert owner.notifications(expect=1) == [b"fresh"]


@pytest.mark.timeout(120)
def test_nixl_owner_killed_frozen_or_dead() -> None:
    reader = make_transfer("nixl", "reader", role="reader", read_timeout_s=TIMEOUT_S)
    slots = reader.allocate_slots(LOCAL_BLOCKS, PAGES)
    fill(slots, seed=0)
    reader.register(slots)
    pairs = scattered_pairs(seed=5)
    with contextlib.ExitStack() as stack:  # start the four owners in parallel
        killed, frozen, dead, fresh = (
            stack.enter_context(owner_process("nixl", REMOTE_BLOCKS, PAGES, seed=s)) for s in (11, 12, 13, 14)
        )

        # Killed mid-read: frozen before the connection exists, so the read stays in flight.
        killed.freeze()
        tid = reader.start_read(killed.info, pairs, notify=b"x")
        time.sleep(0.3)
        assert reader.poll([tid])[tid] == "pending"
        killed.kill()
        status, took = timed_wait(reader, tid)
        assert status == "failed" and took < TIMEOUT_S, (reader.error(tid), took)
        reader.release(tid)

        # Frozen for good: the read deadline turns it into "failed" (and cancels it).
        frozen.freeze()
        tid = reader.start_read(frozen.info, pairs, notify=b"x")
        status, took = timed_wait(reader, tid)
        assert status == "failed" and "timed out" in reader.error(tid)
        assert TIMEOUT_S - 0.4 <= took < TIMEOUT_S + 1.0
        reader.release(tid)
        assert reader.num_pending == 0

        # Dead after a good read: the next read fails at once.
        tid = reader.start_read(dead.info, pairs, notify=b"ok")
        assert reader.wait(tid) == "done", reader.error(tid)
        dead.kill()
        tid = reader.start_read(dead.info.name, pairs, notify=b"x")
        status, took = timed_wait(reader, tid)
        assert status == "failed" and took < TIMEOUT_S, (reader.error(tid), took)
        for name in (killed.info.name, frozen.info.name, dead.info.name):
            reader.remove_peer(name)

        assert_reads_fine(reader, fresh, slots, seed=14)  # the reader still serves other peers
    reader.close()


@pytest.mark.timeout(90)
def test_local_owner_dead_before_or_after_first_read() -> None:
    reader = make_transfer("local", "reader", role="reader", read_timeout_s=TIMEOUT_S)
    slots = reader.allocate_slots(LOCAL_BLOCKS, PAGES)
    fill(slots, seed=0)
    reader.register(slots)
    pairs = scattered_pairs(seed=5)
    with contextlib.ExitStack() as stack:
        gone, dead, fresh = (
            stack.enter_context(owner_process("local", REMOTE_BLOCKS, PAGES, seed=s)) for s in (21, 22, 23)
        )
        info = gone.info
        gone.kill()
        tid = reader.start_read(info, pairs, notify=b"x")  # never reachable: add_peer fails
        assert reader.poll([tid])[tid] == "failed" and "unreachable" in reader.error(tid)

        tid = reader.start_read(dead.info, pairs, notify=b"ok")
        assert reader.wait(tid) == "done", reader.error(tid)
        dead.kill()
        for notify in (b"x", b""):  # detected with or without a notification to send
            tid = reader.start_read(dead.info.name, pairs, notify=notify)
            assert reader.poll([tid])[tid] == "failed" and "gone" in reader.error(tid)

        assert_reads_fine(reader, fresh, slots, seed=23)
    reader.close()


def test_local_undrained_owner_times_out_the_notification() -> None:
    """An owner that never reads its notifications fills the socket: later reads stay pending
    and fail at their deadline; everything delivered before is still there to drain."""
    owner = make_transfer("local", "owner", role="owner")
    reader = make_transfer("local", "reader", role="reader", read_timeout_s=0.3)
    info = owner.register(owner.allocate_slots(4, [64]))
    reader.register(reader.allocate_slots(4, [64]))
    ids = []
    while len(ids) < 200_000:  # until the owner's socket buffer is full (size is a kernel setting)
        ids.append(reader.start_read(info, [(0, 0)], notify=b"n%06d" % len(ids)))
        if reader.poll(ids[-1:])[ids[-1]] == "pending":
            break
    delivered = [i for i, state in reader.poll(ids).items() if state == "done"]
    assert 0 < len(delivered) < len(ids)
    time.sleep(0.35)
    assert reader.poll(ids[len(delivered) :]) == {i: "failed" for i in ids[len(delivered) :]}
    assert len(owner.owner_notifications()) == len(delivered)
    reader.close()
    owner.close()
