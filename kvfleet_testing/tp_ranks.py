"""Run one function on every rank of a tensor-parallel group: ``size`` spawned processes joined
over gloo on loopback (``run_ranks``), or several such groups at once (``run_groups``: a prefill
and a decode worker), for the tests and benchmarks of engine/model/layers/parallel.py and
engine/rank_group.py.

Each rank calls ``fn(rank, size)`` with the default process group initialised, one torch thread
(``threads`` to change it), and hands back what it returns (anything ``torch.save`` takes). A rank
that raises writes its traceback, and ``run_ranks`` raises ``RankError`` with the first one; ranks
still running after the timeout are killed (only the processes this call started) and named.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
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
    return run_groups([fn], size, timeout_s, threads)[0]


def run_groups(
    fns: Sequence[Callable[[int, int], T]], size: int, timeout_s: float = 120, threads: int = 1
) -> list[list[T]]:
    """Several groups of ``size`` ranks at once, each joined on its own port (its own default
    process group: one worker each, e.g. a prefill and a decode worker): per group, per rank,
    ``fns[group](rank, size)``'s result. The groups talk only through what the functions carry
    (e.g. a queue of the spawn context)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tp-ranks-") as tmp:
        outs = [str(Path(tmp) / f"group{g}-rank") for g in range(len(fns))]
        procs = []
        for fn, out in zip(fns, outs, strict=True):
            port = free_port()
            args = [(fn, r, size, port, out, timeout_s, threads) for r in range(size)]
            procs += [ctx.Process(target=_rank_main, args=a, daemon=True) for a in args]
        for proc in procs:
            proc.start()
        end = time.monotonic() + timeout_s * 3
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
        alive = [i for i, p in enumerate(procs) if p.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        errors = sorted(Path(tmp).glob("*.error"))
        if errors:
            raise RankError(f"{errors[0].name}: {errors[0].read_text()}")
        if alive:
            named = [f"group {i // size} rank {i % size}" for i in alive]
            raise RankError(f"{', '.join(named)} did not finish in {timeout_s * 3:.0f} s")
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise RankError(f"ranks exited with {codes}")
        return [[torch.load(f"{out}.{r}", weights_only=False) for r in range(size)] for out in outs]
