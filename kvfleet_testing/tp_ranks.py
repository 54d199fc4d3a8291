"""Run one function on every rank of a tensor-parallel group: ``size`` spawned processes joined
over gloo on loopback (``run_ranks``), for the tests and benchmarks of
engine/model/layers/parallel.py.

Each rank calls ``fn(rank, size)`` with the default process group initialised, one torch thread
(``threads`` to change it), and hands back what it returns (anything ``torch.save`` takes). A rank
that raises writes its traceback, and ``run_ranks`` raises ``RankError`` with the first one; ranks
still running after the timeout are killed (only the processes this call started) and named.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvfleet_testing.ports import free_port

T = TypeVar("T")


class RankError(RuntimeError):
    """A rank failed or did not finish; the message carries its traceback or the ranks still running."""


def _rank_main(
    fn: Callable[[int, int], object], rank: int, size: int, port: int, out: str, timeout_s: float, threads: int
) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        torch.save(fn(rank, size), f"{out}.{rank}")
    except BaseException:
        Path(f"{out}.{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[[int, int], T], size: int, timeout_s: float = 120, threads: int = 1) -> list[T]:
    """``fn(rank, size)``'s result on every rank, in rank order (``fn`` must be picklable: a
    module-level function or a ``functools.partial`` of one)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tp-ranks-") as tmp:
        out = str(Path(tmp) / "rank")
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, size, port, out, timeout_s, threads), daemon=True)
            for r in range(size)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout_s * 3)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        errors = sorted(Path(tmp).glob("rank.*.error"))
        if errors:
            raise RankError(errors[0].read_text())
        if alive:
            raise RankError(f"ranks {alive} of {size} did not finish in {timeout_s * 3:.0f} s")
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise RankError(f"ranks exited with {codes}")
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(size)]
