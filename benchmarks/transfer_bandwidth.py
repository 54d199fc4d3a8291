"""NIXL KV-transfer bandwidth against an in-process copy of the same bytes, in the same run.

What it measures
    An owner process (the prefill side, spawned) registers one slot tensor of 4096 x 64 KiB
    blocks (256 MiB) through ``engine.transfer`` (NIXL, UCX backend, ``role="owner"``). This
    process (the decode side, ``role="reader"``) reads from it with ``start_read`` + ``wait``,
    i.e. NIXL runs BETWEEN TWO PROCESSES, with a completion notification on every read:

    contiguous   all 4096 blocks in order (256 MiB) into the same rows here;
    scattered    512 random distinct blocks out of a 2048-block pool (the owner's first 2048
                 rows) into 512 random distinct rows of a 2048-block pool here;
    setup_ms     per-request setup of a 64-block scattered read with the descriptors prepared
                 at add_peer: pair checks, index arrays, ``make_prepped_xfer`` (median of 200).

    "copy" is done in THIS process from a second 256 MiB tensor holding the same bytes (allocated
    like the slots, by ``allocate_slots``: transparent huge pages) into the reader's slot tensor:
    contiguous = the faster of torch ``dst.copy_(src)`` and numpy ``copyto`` (torch's default
    threads); scattered = the faster of a per-row numpy slice copy loop and torch
    ``index_select`` + ``index_copy_`` of the same 512 rows (the loop wins by ~10x on uint8).
    NIXL timings are end to end (setup, post, completion); copies and NIXL reads alternate
    within each repetition so both see the same machine noise; ratios use medians.

Output
    Progress on stderr (logging). The last stdout line is
    ``{"contiguous_ratio": r, "scattered_ratio": r, "setup_ms": x}`` with ratio = NIXL GB/s /
    copy GB/s. Acceptance: contiguous_ratio >= 0.5, scattered_ratio >= 0.3, setup_ms <= 1.0.
    ``--sweep`` first measures other progress-thread settings (logged, not in the JSON line).

    python -m benchmarks.transfer_bandwidth [--reps 9] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch

from engine.transfer import make_transfer

log = logging.getLogger("transfer_bandwidth")

PAGE = 64 * 1024
NUM_BLOCKS = 4096  # 256 MiB
POOL = 2048
SCATTERED = 512
SETUP_BLOCKS = 64
SEED = 1234


@dataclass(frozen=True)
class Mode:
    """Progress-thread setting of the owner and the reader (delay: the thread's poll timeout)."""

    label: str
    owner_thread: bool
    reader_thread: bool
    delay_us: int = 1000
    owner_polls: bool = False  # the owner's main thread calls owner_notifications() every 1 ms


CHOSEN = Mode("owner thread (1 ms poll), reader none  [engine default]", True, False)
SWEEP = [
    Mode("owner thread (stock 0 us = busy poll), reader none", True, False, delay_us=0),
    Mode("owner and reader threads (1 ms poll)", True, True),
    Mode("no threads, owner polls notifications every 1 ms", False, False, owner_polls=True),
]


def source(num_blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (num_blocks, PAGE), generator=g, dtype=torch.uint8)


def owner_main(conn: Connection, mode: Mode) -> None:
    """The prefill side: registers 256 MiB, then serves until told to stop."""
    xfer = make_transfer(
        "nixl", "bench-owner", role="owner", progress_thread=mode.owner_thread, progress_delay_us=mode.delay_us
    )
    (slot,) = xfer.allocate_slots(NUM_BLOCKS, [PAGE])
    slot.copy_(source(NUM_BLOCKS))
    conn.send(xfer.register([slot]))
    received = 0
    while True:
        if mode.owner_polls:
            received += len(xfer.owner_notifications())
            if not conn.poll(0.001):
                continue
        cmd = conn.recv()
        if cmd == "stop":
            end = time.monotonic() + 0.2  # let the last notifications land
            while time.monotonic() < end:
                received += len(xfer.owner_notifications())
                time.sleep(0.005)
            conn.send(received)
            xfer.close()
            return


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_copy(candidates: dict[str, Callable[[], object]]) -> tuple[str, float]:
    times = {name: timed(fn) for name, fn in candidates.items()}
    name = min(times, key=times.get)
    return name, times[name]


def scattered_copies(
    src: torch.Tensor, dst: torch.Tensor, remote: np.ndarray, local: np.ndarray
) -> dict[str, Callable[[], object]]:
    """In-process ways to copy rows ``remote`` of ``src`` into rows ``local`` of ``dst``."""
    src_np, dst_np = src.numpy(), dst.numpy()
    remote_t, local_t = torch.from_numpy(remote), torch.from_numpy(local)

    def row_loop() -> None:
        for r, d in zip(remote.tolist(), local.tolist(), strict=True):
            dst_np[d] = src_np[r]

    def index_copy() -> None:
        dst.index_copy_(0, local_t, src.index_select(0, remote_t))

    return {"numpy row loop": row_loop, "torch index_copy_": index_copy}


def measure(mode: Mode, reps: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=owner_main, args=(child, mode), daemon=True)
    proc.start()
    reader = make_transfer(
        "nixl", "bench-reader", role="reader", progress_thread=mode.reader_thread, progress_delay_us=mode.delay_us
    )
    (dst,) = reader.allocate_slots(NUM_BLOCKS, [PAGE])
    reader.register([dst])
    (src,) = reader.allocate_slots(NUM_BLOCKS, [PAGE])  # same memory kind as the slots (huge pages)
    src.copy_(source(NUM_BLOCKS))
    src_np, dst_np = src.numpy(), dst.numpy()
    if not conn.poll(120):
        raise RuntimeError("owner process did not start")
    info = conn.recv()
    peer = reader.add_peer(info)
    num_reads = 0

    def nixl_read(pairs: np.ndarray) -> float:
        nonlocal num_reads
        t0 = time.perf_counter()
        tid = reader.start_read(peer, pairs, notify=b"bench")
        status = reader.wait(tid)
        took = time.perf_counter() - t0
        if status != "done":
            raise RuntimeError(f"read failed: {reader.error(tid)}")
        reader.release(tid)
        num_reads += 1
        return took

    all_blocks = np.arange(NUM_BLOCKS)
    nixl_read(np.stack([all_blocks[:8], all_blocks[:8]], axis=1))  # connection wire-up
    nixl_read(np.stack([all_blocks, all_blocks], axis=1))
    if not torch.equal(dst, src):
        raise RuntimeError("NIXL contiguous read: bytes differ from the owner's")

    rng = np.random.default_rng(0)
    contig_nixl, contig_copy, scat_nixl, scat_copy = [], [], [], []
    winners: dict[str, int] = {}
    for rep in range(reps):
        contig_nixl.append(nixl_read(np.stack([all_blocks, all_blocks], axis=1)))
        name, t = best_copy({"torch copy_": lambda: dst.copy_(src), "numpy copyto": lambda: np.copyto(dst_np, src_np)})
        contig_copy.append(t)
        winners[name] = winners.get(name, 0) + 1

        remote = rng.choice(POOL, SCATTERED, replace=False)
        local = rng.choice(POOL, SCATTERED, replace=False)
        scat_nixl.append(nixl_read(np.stack([remote, local], axis=1)))
        if not np.array_equal(dst_np[local], src_np[remote]):
            raise RuntimeError("NIXL scattered read: bytes differ from the owner's")
        name, t = best_copy(scattered_copies(src, dst, remote, local))
        scat_copy.append(t)
        winners[name] = winners.get(name, 0) + 1
        log.info(
            "rep %d: contiguous nixl %.2f / copy %.2f GB/s; scattered nixl %.2f / copy %.2f GB/s",
            rep,
            gbps(NUM_BLOCKS * PAGE, contig_nixl[-1]),
            gbps(NUM_BLOCKS * PAGE, contig_copy[-1]),
            gbps(SCATTERED * PAGE, scat_nixl[-1]),
            gbps(SCATTERED * PAGE, scat_copy[-1]),
        )

    setup, e2e = [], []
    for _ in range(200):
        remote = rng.choice(POOL, SETUP_BLOCKS, replace=False)
        pairs = np.stack([remote, rng.choice(POOL, SETUP_BLOCKS, replace=False)], axis=1)
        t0 = time.perf_counter()
        tid = reader.start_read(peer, pairs, notify=b"bench")
        reader.wait(tid)
        e2e.append(time.perf_counter() - t0)
        setup.append(reader.read_record(tid).setup_s)
        reader.release(tid)
        num_reads += 1

    conn.send("stop")
    received = conn.recv() if conn.poll(10) else -1
    proc.join(10)
    reader.close()
    log.info("copy winners: %s; owner received %d of %d notifications", winners, received, num_reads)
    res = {
        "nixl_contiguous_gbps": statistics.median(gbps(NUM_BLOCKS * PAGE, t) for t in contig_nixl),
        "copy_contiguous_gbps": statistics.median(gbps(NUM_BLOCKS * PAGE, t) for t in contig_copy),
        "nixl_scattered_gbps": statistics.median(gbps(SCATTERED * PAGE, t) for t in scat_nixl),
        "copy_scattered_gbps": statistics.median(gbps(SCATTERED * PAGE, t) for t in scat_copy),
        "setup_ms": statistics.median(setup) * 1e3,
        "read64_ms": statistics.median(e2e) * 1e3,
    }
    log.info(
        "%s: contiguous %.2f vs %.2f GB/s, scattered %.2f vs %.2f GB/s, setup %.3f ms, 64-block read %.2f ms",
        mode.label,
        res["nixl_contiguous_gbps"],
        res["copy_contiguous_gbps"],
        res["nixl_scattered_gbps"],
        res["copy_scattered_gbps"],
        res["setup_ms"],
        res["read64_ms"],
    )
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--sweep", action="store_true", help="also measure other progress-thread settings")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if args.sweep:
        for mode in SWEEP:
            measure(mode, args.reps)
    res = measure(CHOSEN, args.reps)
    print(
        json.dumps(
            {
                "contiguous_ratio": round(res["nixl_contiguous_gbps"] / res["copy_contiguous_gbps"], 3),
                "scattered_ratio": round(res["nixl_scattered_gbps"] / res["copy_scattered_gbps"], 3),
                "setup_ms": round(res["setup_ms"], 4),
            }
        )
    )


if __name__ == "__main__":
    main()
