"""A prefill EngineCore in its own OS process (multiprocessing spawn: the only start method
that works once this process has initialized CUDA), driven over a pipe.

Between commands the process keeps stepping its engine, so it sees the decode side's read
notifications and releases held blocks on its own, as a prefill worker does.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from configs.schema import ClusterConfig
from engine.sampling_params import SamplingParams


def _serve(conn: Connection, config: ClusterConfig) -> None:
    import torch

    from engine.core import EngineCore

    torch.set_num_threads(1)
    engine = EngineCore(config, name="prefill", kv_role="prefill")
    conn.send(("ready", engine.coordinator.num_free_blocks))
    pending: dict[str, Any] = {}
    while True:
        if conn.poll(0 if engine.has_work else 0.01):
            cmd, *args = conn.recv()
            if cmd == "prefill":
                request_id, prompt = args
                engine.add_request(request_id, prompt, SamplingParams(max_tokens=1), prefill_only=True)
                pending[request_id] = None
            elif cmd == "free_blocks":
                conn.send((engine.coordinator.num_free_blocks, len(engine.worker_view.held)))
            elif cmd == "rows":  # raw bytes of blocks, for byte-for-byte comparison (on the CPU)
                conn.send([slot[list(args[0])].cpu() for slot in engine.runner.slots])
            elif cmd == "stop":
                engine.close()
                conn.send("stopped")
                return
        if engine.has_work:
            for result in engine.step():
                if result.request_id in pending and result.finished:
                    del pending[result.request_id]
                    conn.send(("handle", result.kv_handle))


class PrefillProcess:
    """Client side of ``_serve``: start, prefill a prompt into a KVHandle, inspect, kill."""

    def __init__(self, config: ClusterConfig):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, config), daemon=True)
        self.proc.start()
        child.close()
        self.baseline_free = self._recv("ready", 120)

    def _recv(self, tag: str, timeout_s: float) -> Any:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.conn.poll(0.05):
                got, value = self.conn.recv()
                assert got == tag, (got, tag)
                return value
            if not self.proc.is_alive():
                raise RuntimeError(f"prefill process died (exit code {self.proc.exitcode})")
        raise TimeoutError(f"prefill process: no {tag!r} within {timeout_s} s")

    def prefill(self, request_id: str, prompt: list[int]) -> Any:
        self.conn.send(("prefill", request_id, prompt))
        return self._recv("handle", 60)

    def free_blocks(self) -> tuple[int, int]:
        """``(free blocks, requests still held)``."""
        self.conn.send(("free_blocks",))
        return self.conn.recv()

    def wait_released(self, timeout_s: float = 10.0) -> tuple[int, int]:
        end = time.monotonic() + timeout_s
        while True:
            free, held = self.free_blocks()
            if held == 0 or time.monotonic() > end:
                return free, held
            time.sleep(0.02)

    def rows(self, block_ids: list[int]) -> list[Any]:
        self.conn.send(("rows", block_ids))
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.conn.send(("stop",))
                self.conn.poll(10) and self.conn.recv()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


@contextlib.contextmanager
def prefill_process(config: ClusterConfig) -> Iterator[PrefillProcess]:
    proc = PrefillProcess(config)
    try:
        yield proc
    finally:
        proc.stop()
