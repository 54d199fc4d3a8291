"""The local backend with CUDA slot memory (``engine/transfer/local_cuda.py``): allocation and
registration, reads from an owner in this process (its own tensors) and in a spawned one (CUDA
IPC) byte for byte, reads queued behind earlier kernels, owners that go away. Everything but
the first two tests needs a GPU; those two check the errors on any host."""

from __future__ import annotations

import dataclasses
import pickle
import time

import pytest
import torch

from engine.transfer import AgentInfo, TransferError, make_transfer
from tests.transfer.helpers import LOCAL_BLOCKS, PAGES, REMOTE_BLOCKS, assert_plain, expected_after, scattered_pairs
from tests.transfer.owner_proc import owner_process, source_slots

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fill(slots: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Random bytes into ``slots``; returns a CPU copy of them."""
    g = torch.Generator().manual_seed(seed)
    for t in slots:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    return [t.cpu() for t in slots]


def assert_slots(slots: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for s, (got, expected) in enumerate(zip(slots, want, strict=True)):
        assert torch.equal(got.cpu(), expected), f"slot {s}"


def drain(owner, expect: int, timeout_s: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    end = time.monotonic() + timeout_s
    while len(got) < expect and time.monotonic() < end:
        got += owner.owner_notifications()
        time.sleep(0.001)
    return got


# -- any host --------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a host without CUDA")
def test_cuda_slots_without_cuda_fail_naming_the_problem() -> None:
    xfer = make_transfer("local", "w")
    with pytest.raises(TransferError, match=r"torch.cuda.is_available"):
        xfer.allocate_slots(4, [64], "cuda")
    with pytest.raises(ValueError, match="CPU or CUDA"):
        xfer.allocate_slots(4, [64], "meta")
    xfer.close()


def test_cpu_and_cuda_slots_do_not_mix() -> None:
    """A reader whose slots are in DRAM refuses an owner in VRAM (and the reverse), by name."""
    owner = make_transfer("local", "owner", role="owner")
    reader = make_transfer("local", "reader", role="reader")
    info = owner.register(owner.allocate_slots(4, [64]))
    reader.register(reader.allocate_slots(4, [64]))
    on_gpu = dataclasses.replace(info, name=info.name + "-gpu", mem_type="VRAM")
    tid = reader.start_read(on_gpu, [(0, 0)], notify=b"x")
    assert reader.poll([tid])[tid] == "failed" and "same kind" in reader.error(tid)
    assert drain(owner, 1, timeout_s=0.05) == []
    reader.close()
    owner.close()


# -- one process -----------------------------------------------------------------------------
@pytest.fixture
def cuda_pair():
    """An owner and a reader with CUDA slots in this process, registered; the owner's bytes."""
    owner = make_transfer("local", "owner", role="owner", read_timeout_s=10.0)
    reader = make_transfer("local", "reader", role="reader", read_timeout_s=10.0)
    src = owner.allocate_slots(REMOTE_BLOCKS, PAGES, "cuda")
    source = fill(src, seed=1)
    info = owner.register(src)
    dst = reader.allocate_slots(LOCAL_BLOCKS, PAGES, "cuda")
    reader.register(dst)
    yield owner, reader, info, src, dst, source
    reader.close()
    owner.close()


@needs_cuda
def test_allocate_and_register_give_cuda_slots_and_plain_data(cuda_pair) -> None:
    _, _, info, src, dst, _ = cuda_pair
    for t, rows in [(t, REMOTE_BLOCKS) for t in src] + [(t, LOCAL_BLOCKS) for t in dst]:
        assert t.is_cuda and t.dtype == torch.uint8 and t.shape[0] == rows
    assert [t.shape[1] for t in dst] == PAGES and not any(t.any() for t in dst)
    assert info.mem_type == "VRAM" and len(info.cuda_ipc) == len(PAGES) and not info.shm_paths
    for f in dataclasses.fields(AgentInfo):
        assert_plain(getattr(info, f.name))
    assert pickle.loads(pickle.dumps(info)) == info
    xfer = make_transfer("local", "w")
    with pytest.raises(TransferError, match="allocate_slots"):
        xfer.register([torch.zeros(4, 64, dtype=torch.uint8, device="cuda")])
    xfer.close()


@needs_cuda
@pytest.mark.parametrize("pairs", [scattered_pairs(seed=3), [(10, 4), (11, 5), (12, 6)]], ids=["scattered", "one-run"])
def test_same_process_read_and_notify(cuda_pair, pairs) -> None:
    """Scattered pairs take the gather/scatter copy, one run the slice copy."""
    owner, reader, info, _, dst, source = cuda_pair
    before = [t.cpu() for t in dst]
    tid = reader.start_read(info, pairs, notify=b"req")
    assert reader.wait(tid) == "done", reader.error(tid)
    assert reader.read_record(tid).num_blocks == len(pairs)
    assert_slots(dst, expected_after(before, source, pairs))
    assert drain(owner, 1) == [b"req"]
    tid = reader.start_read(info.name, [], notify=b"hit")  # notification only
    assert reader.wait(tid) == "done" and drain(owner, 1) == [b"hit"]


@needs_cuda
def test_pools_of_different_row_counts() -> None:
    owner = make_transfer("local", "owner", role="owner")
    reader = make_transfer("local", "reader", role="reader")
    src = owner.allocate_slots([16, 16, 6], [256, 256, 96], "cuda")
    source = fill(src, seed=4)
    info = owner.register(src, [0, 0, 1])
    dst = reader.allocate_slots([8, 8, 3], [256, 256, 96], "cuda")
    reader.register(dst, [0, 0, 1])
    triples = [(0, 15, 0), (0, 3, 7), (1, 5, 2), (1, 0, 0)]
    tid = reader.start_read(info, triples, notify=b"pools")
    assert reader.wait(tid) == "done", reader.error(tid)
    want = [torch.zeros(t.shape, dtype=torch.uint8) for t in dst]
    for pool, remote, local in triples:  # a pair moves its row of every slot of its pool, nothing else
        for s in [0, 1] if pool == 0 else [2]:
            want[s][local] = source[s][remote]
    assert_slots(dst, want)
    reader.close()
    owner.close()


def sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds`` (at least)."""
    return int(seconds * 2.5e9)  # no GPU clock here exceeds 2.5 GHz


@needs_cuda
def test_a_read_queued_behind_busy_kernels_is_done_only_once_the_bytes_are_there(cuda_pair) -> None:
    """The owner's new bytes are written behind a ~0.3 s kernel on this process's stream; the
    read is queued after them. It stays pending, and the owner unnotified, until they landed."""
    owner, reader, info, src, dst, _ = cuda_pair
    fresh = [torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device) for t in src]
    torch.cuda.synchronize()
    pairs = scattered_pairs(seed=6)
    before = [t.cpu() for t in dst]
    torch.cuda._sleep(sleep_cycles(0.3))
    for t, new in zip(src, fresh, strict=True):
        t.copy_(new)
    tid = reader.start_read(info, pairs, notify=b"late")
    assert reader.poll([tid])[tid] == "pending"
    assert owner.owner_notifications() == []
    assert reader.wait(tid) == "done", reader.error(tid)
    assert drain(owner, 1) == [b"late"]
    assert_slots(dst, expected_after(before, [t.cpu() for t in fresh], pairs))


@needs_cuda
def test_releasing_a_read_still_copying_waits_for_the_copy(cuda_pair) -> None:
    owner, reader, info, _, _, _ = cuda_pair
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles(0.3))
    tid = reader.start_read(info, scattered_pairs(seed=7), notify=b"gone")
    assert reader.poll([tid])[tid] == "pending"
    reader.release(tid)
    assert torch.cuda.current_stream().query()  # nothing of the read is left queued
    assert drain(owner, 1, timeout_s=0.1) == []  # and the owner was never told


@needs_cuda
def test_same_process_owner_closed_is_unreachable(cuda_pair) -> None:
    owner, reader, info, _, _, _ = cuda_pair
    owner.close()
    tid = reader.start_read(info, [(0, 0)], notify=b"x")
    assert reader.poll([tid])[tid] == "failed" and "unreachable" in reader.error(tid)


# -- two processes (CUDA IPC) ----------------------------------------------------------------
@needs_cuda
@pytest.mark.timeout(120)
def test_scattered_rows_from_an_owner_in_another_process() -> None:
    with owner_process("local", REMOTE_BLOCKS, PAGES, seed=1, device="cuda") as owner:
        assert owner.info.mem_type == "VRAM" and owner.info.pid == owner.proc.pid
        reader = make_transfer("local", "reader", role="reader", read_timeout_s=10.0)
        slots = reader.allocate_slots(LOCAL_BLOCKS, PAGES, "cuda")
        before = fill(slots, seed=2)
        reader.register(slots)
        source = source_slots(REMOTE_BLOCKS, PAGES, seed=1)

        pairs = scattered_pairs(seed=3)
        tid = reader.start_read(owner.info, pairs, notify=b"req-1")
        assert reader.wait(tid) == "done", reader.error(tid)
        assert reader.read_record(tid).num_blocks == len(pairs)
        expected = expected_after(before, source, pairs)
        assert_slots(slots, expected)

        more = [(47, 5), (0, 6), (23, 39)]  # the slice copy, same peer (opened once)
        t2 = reader.start_read(owner.info.name, more, notify=b"req-2")
        t3 = reader.start_read(owner.info.name, [], notify=b"req-3")
        assert reader.wait(t2) == "done" and reader.wait(t3) == "done"
        assert_slots(slots, expected_after(expected, source, more))
        assert sorted(owner.notifications(expect=3)) == [b"req-1", b"req-2", b"req-3"]
        for t in (tid, t2, t3):
            reader.release(t)
        reader.close()


@needs_cuda
@pytest.mark.timeout(120)
def test_an_owner_in_another_process_dead_before_or_after_the_first_read() -> None:
    reader = make_transfer("local", "reader", role="reader", read_timeout_s=2.0)
    slots = reader.allocate_slots(LOCAL_BLOCKS, PAGES, "cuda")
    fill(slots, seed=0)
    reader.register(slots)
    pairs = scattered_pairs(seed=5)
    with owner_process("local", REMOTE_BLOCKS, PAGES, seed=21, device="cuda") as gone:
        info = gone.info
        gone.kill()
        tid = reader.start_read(info, pairs, notify=b"x")  # never opened: add_peer fails first
        assert reader.poll([tid])[tid] == "failed" and "unreachable" in reader.error(tid)
    with owner_process("local", REMOTE_BLOCKS, PAGES, seed=22, device="cuda") as dead:
        tid = reader.start_read(dead.info, pairs, notify=b"ok")
        assert reader.wait(tid) == "done", reader.error(tid)
        dead.kill()
        for notify in (b"x", b""):
            tid = reader.start_read(dead.info.name, pairs, notify=notify)
            assert reader.poll([tid])[tid] == "failed" and "gone" in reader.error(tid)
        reader.remove_peer(dead.info.name)
    with owner_process("local", REMOTE_BLOCKS, PAGES, seed=23, device="cuda") as fresh:
        before = [t.cpu() for t in slots]
        tid = reader.start_read(fresh.info, pairs, notify=b"fresh")
        assert reader.wait(tid) == "done", reader.error(tid)
        assert_slots(slots, expected_after(before, source_slots(REMOTE_BLOCKS, PAGES, seed=23), pairs))
        assert fresh.notifications(expect=1) == [b"fresh"]
    torch.cuda.synchronize()  # the CUDA context is still healthy
    reader.close()
