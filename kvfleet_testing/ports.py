"""Loopback ports for components the tests and benchmarks start (``free_port``)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1", preferred: int | None = None) -> int:
    """A TCP port on ``host``: ``preferred`` when it can be bound now, else one the OS just called
    free (for components whose port cannot be 0). Nothing holds it after the call returns."""
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError(f"no free port on {host}")
