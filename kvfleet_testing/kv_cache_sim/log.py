"""``SimLog``: what a ``Sim`` reports while it runs (outcome tags, the recent operations) and how it
fails (``SimViolation`` naming the configuration and the recent operations).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import NoReturn

from kvfleet_testing.kv_cache_sim.configs import SimConfig
from kvfleet_testing.kv_cache_sim.records import SimViolation


class SimLog:
    """Owns ``counts`` (outcome tags and demoted blocks, by name) and ``trace`` (the most recent
    operations, at most ``trace_len``) of one simulator run. Counts only grow; ``fail`` always raises
    ``SimViolation`` with the run's configuration and its last 12 operations."""

    def __init__(self, cfg: SimConfig, trace_len: int) -> None:
        self.cfg = cfg
        self.counts: Counter[str] = Counter()
        self.trace: deque[str] = deque(maxlen=trace_len)

    def fail(self, message: str) -> NoReturn:
        raise SimViolation(f"{message}\n  config: {self.cfg.describe()}\n  recent ops: {list(self.trace)[-12:]}")

    def note(self, text: str) -> None:
        """One line of the trace."""
        self.trace.append(text)

    def tag(self, name: str, n: int = 1) -> None:
        """Count an outcome (``n`` at once: blocks demoted by one call)."""
        self.counts[name] += n
