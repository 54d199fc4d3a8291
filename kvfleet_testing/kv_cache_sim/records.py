"""The simulator's shared vocabulary: request states (``WAITING``, ``RUNNING``, ``LOADING``,
``FINISHED``), ``cdiv``, ``SimViolation`` and the records the simulator keeps (``SimRequest``,
``Snapshot``, ``PinRecord``). Imports nothing else of the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache import CacheRequest

WAITING = "waiting"
RUNNING = "running"
LOADING = "loading"  # waiting for remote / external KV (owns blocks, computes nothing)
FINISHED = "finished"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SimViolation(AssertionError):
    """The coordinator broke a property the simulated scheduler checks (beyond check_invariants)."""


# -- requests ---------------------------------------------------------------------------------------------
@dataclass(eq=False)
class SimRequest:
    """One simulated request around its ``CacheRequest``. ``state`` is one of the four states;
    ``load`` is set exactly while LOADING; ``order`` grows with every admission (or load completion)."""

    req: CacheRequest
    max_tokens: int
    state: str = WAITING
    generated: int = 0
    order: int = 0  # admission order (FCFS preemption picks the newest)
    load: tuple[int, int] | None = None  # (local hit, hit + external) while LOADING
    preemptions: int = 0

    @property
    def rid(self) -> str:
        return self.req.request_id


@dataclass
class Snapshot:
    """The coordinator's state before an ``allocate_slots`` call: per-pool ref counts, per-group
    cache maps, every admitted request's block-id tables. A failed allocation must leave it unchanged
    but for window drops of the requester."""

    refs: list[list[int]]  # per pool, per block id
    cached: list[dict[bytes, int]]  # per group
    tables: dict[str, list[list[int]]]
    admitted: set[str]


@dataclass
class PinRecord:
    """One ``pin_prefix`` call (hashes, token count) and the tokens it pinned; its ``unpin_prefix``
    undo uses the same arguments."""

    hashes: list[bytes]
    num_tokens: int
    pinned: int
