"""The server of ``benchmarks/serve_bench.py``: ``kvfleet serve`` started and stopped as a subprocess.

Owns ``Server`` (a ``kvfleet serve`` on a free loopback port from ``kvfleet_testing.ports``:
started, ready once its URL is printed and /health answers 200, stopped with SIGINT, its process group killed if it
does not exit) and the pattern of the URL it prints (``URL_RE``).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from benchmarks.support.serve_http import get_status
from kvfleet_testing.ports import free_port

log = logging.getLogger("serve_bench")
URL_RE = re.compile(r"https?://[\w.\-]+:\d+")


class Server:
    """``kvfleet serve`` as a subprocess on a free loopback port: started, ready (its URL printed
    and /health 200), stopped with SIGINT (SIGKILL to its process group if it does not exit)."""

    def __init__(
        self,
        kvfleet: str,
        config: str,
        overrides: Sequence[str],
        log_path: Path,
        start_timeout_s: float = 900.0,
        stop_timeout_s: float = 90.0,
    ):
        self.port = free_port()
        self.cmd = [kvfleet, "serve", "--config", config]
        for override in [*overrides, f"serve.port={self.port}"]:
            self.cmd += ["--set", override]
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.url = ""
        self.start_s = 0.0
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Self:
        started = time.monotonic()
        log_file = self.log_path.open("w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=log_file, text=True, start_new_session=True
        )
        log_file.close()
        found = threading.Event()
        threading.Thread(target=self._read_stdout, args=(found,), daemon=True).start()
        try:
            while not found.wait(0.5):
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode} before it was ready; see {self.log_path}"
                    )
                if time.monotonic() - started > self.start_timeout_s:
                    raise TimeoutError(f"server not ready after {self.start_timeout_s:.0f} s; see {self.log_path}")
            while get_status(self.url, "/health") != 200:
                if time.monotonic() - started > self.start_timeout_s:
                    raise TimeoutError(f"{self.url}/health not 200 after {self.start_timeout_s:.0f} s")
                time.sleep(0.5)
        except BaseException:
            self.__exit__()
            raise
        self.start_s = time.monotonic() - started
        log.info("server ready at %s in %.1f s: %s", self.url, self.start_s, " ".join(self.cmd[1:]))
        return self

    def _read_stdout(self, found: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.with_suffix(".stdout").open("w") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                match = URL_RE.search(line)
                if match and f":{self.port}" in match.group(0) and not found.is_set():
                    self.url = match.group(0)
                    found.set()

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(self.stop_timeout_s)
            log.info("server stopped (exit %s) in %.1f s", proc.returncode, time.monotonic() - started)
        except subprocess.TimeoutExpired:
            log.warning("server did not exit %.0f s after SIGINT; killing its process group", self.stop_timeout_s)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
