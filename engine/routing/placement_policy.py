"""The interface every placement policy offers (kvfleet's and the baselines) and its bookkeeping.

``engine.routing.factory.build_router`` builds the policy ``RouterConfig.policy`` names. Subclasses implement
``route`` and, for state of their own, the ``_added`` / ``_removed`` membership hooks.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import replace

from engine.kv_cache.events import KVEvent
from engine.routing.index import WorkerSnapshot
from engine.routing.types import (
    Action,
    Decision,
    NoWorkerError,
    Role,
    RouteRequest,
    WorkerId,
    WorkerLoad,
)

POLICIES = ("kvfleet", "round_robin", "least_loaded", "prefix_tree")


class PlacementPolicy(ABC):
    """The interface every placement policy offers (kvfleet's and the baselines).

    Membership, load stats and actions are common; policies that ignore KV events keep the no-op
    ``apply_events``. Loads: the caller reports ``update_load``; between reports the router adds
    its own assignments (``route`` counts the request's uncached tokens and one running request
    on the chosen workers) so a burst does not all land on one worker.
    """

    name = "base"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.roles: dict[WorkerId, Role] = {}
        self.loads: dict[WorkerId, WorkerLoad] = {}
        self.num_blocks: dict[WorkerId, int | None] = {}

    # -- membership and loads -------------------------------------------------------------------------
    @property
    def workers(self) -> list[WorkerId]:
        return list(self.roles)

    def add_worker(
        self,
        worker: WorkerId,
        role: Role = "both",
        num_blocks: int | None = None,
        snapshot: WorkerSnapshot | None = None,
        now: float = 0.0,
    ) -> list[Action]:
        if worker in self.roles:
            raise ValueError(f"worker {worker!r} is already registered")
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role: must be 'both', 'prefill' or 'decode' (got {role!r})")
        self.roles[worker] = role
        self.loads[worker] = WorkerLoad()
        self.num_blocks[worker] = num_blocks
        return self._added(worker, snapshot, now)

    def remove_worker(self, worker: WorkerId, now: float = 0.0) -> list[Action]:
        """Forget a worker that left or died (unknown workers are ignored)."""
        if worker not in self.roles:
            return []
        del self.roles[worker]
        self.num_blocks.pop(worker, None)
        return self._removed(worker, self.loads.pop(worker), now)

    def _added(self, worker: WorkerId, snapshot: WorkerSnapshot | None, now: float) -> list[Action]:
        """Policy-specific state for a new worker (base: none)."""
        return []

    def _removed(self, worker: WorkerId, load: WorkerLoad, now: float) -> list[Action]:
        """Drop policy-specific state of a removed worker (base: none)."""
        return []

    def update_load(self, worker: WorkerId, load: WorkerLoad) -> None:
        if worker in self.loads:
            self.loads[worker] = replace(load)  # the router adds its own assignments to its copy

    # -- events ---------------------------------------------------------------------------------------
    def apply_events(self, worker: WorkerId, events: Iterable[KVEvent], now: float = 0.0) -> list[Action]:
        return []

    def apply_snapshot(self, worker: WorkerId, snapshot: WorkerSnapshot, now: float = 0.0) -> list[Action]:
        return []

    def tick(self, now: float) -> list[Action]:
        return []

    # -- placement ------------------------------------------------------------------------------------
    @abstractmethod
    def route(self, request: RouteRequest, now: float = 0.0) -> Decision:
        raise NotImplementedError

    def _record(self, decision: Decision) -> None:
        """Count the assignment until the next load report."""
        load = self.loads[decision.prefill_worker]
        load.queued_tokens += decision.uncached_tokens
        load.running_requests += 1
        if decision.decode_worker != decision.prefill_worker:
            self.loads[decision.decode_worker].running_requests += 1

    def _candidates(self, role: Role) -> list[WorkerId]:
        want = ("both", role)
        return [w for w, r in self.roles.items() if r in want]

    def _require(self, workers: list[WorkerId], role: str) -> None:
        if not workers:
            raise NoWorkerError(f"no {role} worker is registered with the router")
