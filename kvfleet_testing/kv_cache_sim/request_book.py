"""``RequestBook``: the simulated scheduler's requests (live, recently finished, scheduled in this
step) and the counters that name and order them.
"""

from __future__ import annotations

from collections import deque

from kvfleet_testing.kv_cache_sim.records import LOADING, RUNNING, SimRequest


class RequestBook:
    """Owns the live requests by id in arrival order (WAITING, RUNNING or LOADING), the last 12
    finished ones, the ids computed in the current step (in order) and whether the step preempted.
    Request ids are ``r0, r1, ...`` in arrival order; each ``stamp_order`` gives a request a larger
    admission order than any before; a retired request is neither live nor scheduled."""

    def __init__(self) -> None:
        self._live: dict[str, SimRequest] = {}
        self._finished: deque[SimRequest] = deque(maxlen=12)
        self._scheduled: list[str] = []
        self._preempted = False
        self._next_id = 0
        self._next_order = 0

    # -- requests ------------------------------------------------------------------------------------------
    def new_rid(self) -> str:
        rid = f"r{self._next_id}"
        self._next_id += 1
        return rid

    def add(self, r: SimRequest) -> None:
        self._live[r.rid] = r

    def get(self, rid: str) -> SimRequest | None:
        return self._live.get(rid)

    def live(self, *states: str) -> list[SimRequest]:
        """Live requests in one of ``states``, in arrival order."""
        return [r for r in self._live.values() if r.state in states]

    def everyone(self) -> list[SimRequest]:
        """Every live request, in arrival order."""
        return list(self._live.values())

    def finished(self) -> list[SimRequest]:
        """The most recently finished requests, oldest first."""
        return list(self._finished)

    def known(self) -> list[SimRequest]:
        """Live requests, then the recently finished ones."""
        return [*self._live.values(), *self._finished]

    def admitted_ids(self) -> set[str]:
        """The requests the coordinator must admit: RUNNING and LOADING."""
        return {r.rid for r in self._live.values() if r.state in (RUNNING, LOADING)}

    def stamp_order(self, r: SimRequest) -> None:
        """``r`` is admitted (or its load completed) now: FCFS preemption takes the newest first."""
        self._next_order += 1
        r.order = self._next_order

    def retire(self, r: SimRequest) -> None:
        """``r`` finished or was aborted: it leaves the live set and the step's schedule."""
        self._live.pop(r.rid, None)
        self.unschedule(r.rid)
        self._finished.append(r)

    # -- the current step ----------------------------------------------------------------------------------
    def schedule(self, rid: str) -> None:
        self._scheduled.append(rid)

    def unschedule(self, rid: str) -> None:
        if rid in self._scheduled:
            self._scheduled.remove(rid)

    def is_scheduled(self, rid: str) -> bool:
        return rid in self._scheduled

    def scheduled(self) -> list[str]:
        """The ids computed in this step, in order (a copy)."""
        return list(self._scheduled)

    def new_step(self) -> None:
        """The step ended: nothing scheduled, nothing preempted yet."""
        self._scheduled.clear()
        self._preempted = False

    def mark_preempted(self) -> None:
        """A request was preempted in this step: no admission follows until the step ends."""
        self._preempted = True

    def preempted(self) -> bool:
        return self._preempted
