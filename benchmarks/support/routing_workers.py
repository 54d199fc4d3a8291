"""The simulated workers of ``benchmarks/routing_sim.py``.

Owns a worker's state (``SimWorker``: its real ``HybridCoordinator``, FIFO queue, requests
waiting for KV room, busy time) and the unit of work it serves (``Job``: a routed request or a
pin's warm-up prefill). The event loop that drives them is ``routing_simulation.Simulation``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from benchmarks.support.routing_trace import GROUPS
from engine.kv_cache import CacheRequest, HybridCoordinator, KVCacheGroup, RetentionOptions
from engine.routing import PinOn, WorkerLoad


# -- workers ---------------------------------------------------------------------------------------------------
@dataclass
class Job:
    """A request on a worker (or a pin's warm-up prefill): its KV request, hit and work."""

    rid: str
    request: CacheRequest
    arrival: float
    output: int
    trace_index: int | None = None  # None: a pin warm-up
    predicted: int = -1
    pin: PinOn | None = None
    hit: int = 0
    uncached: int = 0
    promoted: int = 0  # hit tokens copied back from the host tier
    work: float = 0.0


class SimWorker:
    """One worker: a hybrid coordinator (retention on, a quarter of the pool; a host tier of
    ``host_blocks`` per pool where given) and a FIFO compute server. ``promote_s_per_token``: what
    it reports a host-tier hit token's copy back to the device costs (0: no host tier)."""

    def __init__(
        self,
        name: str,
        num_blocks: int,
        groups: list[KVCacheGroup] | None = None,
        host_blocks: int | None = None,
        promote_s_per_token: float = 0.0,
    ):
        self.name = name
        self.num_blocks = num_blocks
        retention = RetentionOptions(enabled=True, budget_blocks=num_blocks // 4, min_drop_blocks=2)
        self.coord = HybridCoordinator(
            groups or GROUPS, num_blocks, retention=retention, enable_events=True, host_blocks=host_blocks
        )
        self.promote_s_per_token = promote_s_per_token if host_blocks else 0.0
        self.queue: deque[Job] = deque()
        self.pending: deque[Job] = deque()
        self.current: Job | None = None
        self.current_end = 0.0
        self.alive = True
        self.busy = 0.0
        self.busy_measured = 0.0  # busy time after the warm-up (the first measured arrival)
        self.queued_work = 0.0  # work of queued jobs, prefill-token equivalents

    def load(self, now: float, prefill_tps: float) -> WorkerLoad:
        work = self.queued_work + sum(j.request.num_tokens for j in self.pending)
        if self.current is not None:
            work += max(0.0, self.current_end - now) * prefill_tps
        running = len(self.queue) + len(self.pending) + (self.current is not None)
        return WorkerLoad(work, running, self.coord.usage, self.promote_s_per_token)
