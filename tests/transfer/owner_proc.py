"""A prefill-side owner in its own OS process (multiprocessing spawn), for the transfer tests.

The owner fills its slot tensors deterministically from a seed, sends its AgentInfo, then blocks
on the pipe: between commands it makes no transfer call at all, so NIXL reads succeed only if
the owner's configuration (progress thread) lets them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.transfer import AgentInfo


def source_slots(num_blocks: int, page_bytes: Sequence[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (num_blocks, page), generator=g, dtype=torch.uint8) for page in page_bytes]


def run_owner(
    conn: Connection, backend: str, num_blocks: int, page_bytes: Sequence[int], seed: int, device: str = "cpu"
) -> None:
    from engine.transfer import make_transfer

    torch.set_num_threads(1)
    xfer = make_transfer(backend, "owner", role="owner", read_timeout_s=5.0)
    slots = xfer.allocate_slots(num_blocks, page_bytes, device)
    for dst, src in zip(slots, source_slots(num_blocks, page_bytes, seed), strict=False):
        dst.copy_(src)
    conn.send(xfer.register(slots))
    while True:
        cmd = conn.recv()
        if cmd == "notifications":
            conn.send(xfer.owner_notifications())
        elif cmd == "stop":
            xfer.close()
            conn.send("stopped")
            return


@dataclass
class Owner:
    proc: Any
    conn: Connection
    _info: AgentInfo | None = None

    @property
    def info(self) -> AgentInfo:
        """The owner's AgentInfo (waits for the process to start; owners can start in parallel)."""
        end = time.monotonic() + 60
        while self._info is None:
            if self.conn.poll(0.05):
                self._info = self.conn.recv()
            elif not self.proc.is_alive() or time.monotonic() > end:
                raise TimeoutError(f"owner process did not start (exit code {self.proc.exitcode})")
        return self._info

    def notifications(self, expect: int, timeout_s: float = 5.0) -> list[bytes]:
        """Ask until ``expect`` notifications arrived (they may trail the reader's completion)."""
        got: list[bytes] = []
        end = time.monotonic() + timeout_s
        while len(got) < expect and time.monotonic() < end:
            self.conn.send("notifications")
            got += self.conn.recv()
            if len(got) < expect:
                time.sleep(0.01)
        return got

    def freeze(self) -> None:
        self.info  # noqa: B018 - only freeze a fully started owner
        os.kill(self.proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        self.info  # noqa: B018
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


@contextlib.contextmanager
def owner_process(
    backend: str, num_blocks: int, page_bytes: Sequence[int], seed: int, device: str = "cpu"
) -> Iterator[Owner]:
    """An owner process whose slots are on ``device`` (spawned: CUDA cannot be used after fork)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (child, backend, num_blocks, list(page_bytes), seed, device)
    proc = ctx.Process(target=run_owner, args=args, daemon=True)
    proc.start()
    owner = Owner(proc, parent)
    try:
        yield owner
    finally:
        if proc.is_alive():
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGCONT)
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                owner.info  # noqa: B018 - drain the AgentInfo so "stop" is the next message read
                parent.send("stop")
                parent.poll(5) and parent.recv()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
