"""Start and join the processes of one tensor-parallel rank group on this host (gloo on the CPU,
NCCL on CUDA), over 127.0.0.1 with a bounded timeout so a missing rank fails instead of hanging.

``spawn_ranks`` runs ``fn(rank, size, *args)`` in ``size`` fresh processes (torch.multiprocessing
spawn), each joined to the group first and torn down after; an exception on any rank is raised
here. engine/ never imports ray: the actors place the ranks, this module only connects them.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def join_group(rank: int, size: int, port: int, timeout_s: float = 60.0, device: str = "cpu") -> None:
    """Join this process to the group as ``rank`` of ``size``; every collective times out after ``timeout_s``."""
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if device == "cuda":
        torch.cuda.set_device(rank)


def _rank_main(
    rank: int, size: int, port: int, timeout_s: float, fn: Callable[..., None], args: tuple[Any, ...]
) -> None:
    join_group(rank, size, port, timeout_s)
    try:
        fn(rank, size, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., None], size: int, *args: Any, timeout_s: float = 60.0) -> None:
    """Run ``fn(rank, size, *args)`` on ``size`` ranks in new processes and wait for all of them."""
    mp.spawn(_rank_main, args=(size, free_port(), timeout_s, fn, args), nprocs=size, join=True)
