"""In-process checks of the transfer interface: plain data, argument errors, peer handling."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from engine.transfer import AgentInfo, TransferError, make_transfer
from engine.transfer.local import copy_runs
from engine.transfer.pairs import as_pairs
from tests.transfer.helpers import assert_plain

BACKENDS = ["nixl", "local"]


@pytest.fixture(params=BACKENDS)
def pair(request):
    """An owner and a reader of one backend in this process, registered."""
    owner = make_transfer(request.param, "owner", role="owner", read_timeout_s=2.0)
    reader = make_transfer(request.param, "reader", role="reader", read_timeout_s=2.0)
    src = owner.allocate_slots(16, [256, 64])
    for i, t in enumerate(src):
        t.copy_(torch.arange(t.numel(), dtype=torch.int64).add(i).to(torch.uint8).view_as(t))
    info = owner.register(src)
    dst = reader.allocate_slots(8, [256, 64])
    reader.register(dst)
    yield owner, reader, info, src, dst
    reader.close()
    owner.close()


def test_agent_info_and_ids_are_plain_data(pair) -> None:
    _owner, reader, info, _, _ = pair
    for f in dataclasses.fields(AgentInfo):
        assert_plain(getattr(info, f.name))
    blob = pickle.dumps(info)
    assert pickle.loads(blob) == info and b"torch" not in blob
    tid = reader.start_read(info, [(3, 1)], notify=b"r")
    assert type(tid) is int and pickle.loads(pickle.dumps(tid)) == tid
    assert reader.wait(tid) == "done"


def test_same_process_read_and_notify(pair) -> None:
    owner, reader, info, src, dst = pair
    pairs = [(15, 0), (2, 7), (3, 6), (4, 5)]
    tid = reader.start_read(info, pairs, notify=b"req")
    assert reader.wait(tid) == "done", reader.error(tid)
    for s in range(2):
        for remote, local in pairs:
            assert torch.equal(dst[s][local], src[s][remote])
        assert not dst[s][1:5].any()
    assert drain(owner, 1) == [b"req"]


def drain(owner, expect: int) -> list[bytes]:
    got: list[bytes] = []
    end = time.monotonic() + 5
    while len(got) < expect and time.monotonic() < end:
        got += owner.owner_notifications()
        time.sleep(0.001)
    return got


def test_notification_only_to_a_fresh_peer(pair) -> None:
    """A full local hit: nothing to read, but the owner must still hear about it (first contact)."""
    owner, reader, info, _, dst = pair
    tid = reader.start_read(info, [], notify=b"hit")
    assert reader.wait(tid) == "done", reader.error(tid)
    assert reader.read_record(tid).num_blocks == 0 and not any(t.any() for t in dst)
    assert drain(owner, 1) == [b"hit"]


def test_bad_pairs_raise_and_leave_nothing_pending(pair) -> None:
    _, reader, info, _, _ = pair
    reader.add_peer(info)
    for bad in ([(16, 0)], [(0, 8)], [(-1, 0)], [(0, 1), (2, 1)], [(1, 2, 3)]):
        with pytest.raises(ValueError):
            reader.start_read(info.name, bad)
    assert reader.num_pending == 0


def test_unknown_or_incompatible_peer_fails_without_raising(pair) -> None:
    _owner, reader, info, _, _ = pair
    tid = reader.start_read("nobody", [(0, 0)])
    assert reader.poll([tid])[tid] == "failed" and "unknown peer" in reader.error(tid)
    other = dataclasses.replace(info, name=info.name + "-x", page_bytes=(256, 32))
    tid = reader.start_read(other, [(0, 0)])
    assert reader.poll([tid])[tid] == "failed" and "page sizes" in reader.error(tid)
    assert reader.add_peer(info) == reader.add_peer(info) == info.name  # idempotent
    assert reader.peers == [info.name]


def test_register_once_and_local_needs_its_own_memory() -> None:
    xfer = make_transfer("local", "w")
    with pytest.raises(TransferError, match="allocate_slots"):
        xfer.register([torch.zeros(4, 64, dtype=torch.uint8)])
    xfer.register(xfer.allocate_slots(4, [64]))
    with pytest.raises(TransferError, match="already registered"):
        xfer.register(xfer.allocate_slots(4, [64]))
    with pytest.raises(ValueError, match="rows"):
        make_transfer("local").register([torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(5, 8)])
    xfer.close()
    with pytest.raises(ValueError, match="unknown backend"):
        make_transfer("rdma")


def test_pairs_and_runs_helpers() -> None:
    remote, local = as_pairs([(5, 3), (6, 4), (7, 5), (60, 0), (1, 31)], 64, 32)
    assert copy_runs(remote, local) == [(60, 0, 1), (5, 3, 3), (1, 31, 1)]
    assert as_pairs([], 4, 4)[0].size == 0
    assert as_pairs(np.array([[1, 2]]), 4, 4)[1].tolist() == [2]


def test_package_import_is_lazy() -> None:
    code = "import sys, engine.transfer; print('nixl' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
