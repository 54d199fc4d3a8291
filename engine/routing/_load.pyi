"""Types of the compiled load book (``_load.c``); ``load.PyLoadBook`` documents it."""

from collections.abc import Callable, Container, Hashable
from typing import final

from engine.routing.types import Decision, WorkerLoad

@final
class LoadBook:
    @property
    def load_cost(self) -> dict[Hashable, float]: ...
    @property
    def queued(self) -> dict[Hashable, float]: ...
    @property
    def queued_sum(self) -> float: ...
    def __init__(
        self,
        load_halflife_s: float,
        work_halflife_s: float,
        seed: int,
        imbalance_ratio: float,
        imbalance_slack_tokens: float,
        sustained_imbalance_ratio: float,
        work_imbalance_ratio: float,
        request_work_tokens: float,
        anchor_credit: float,
        w_queued: float,
        w_running: float,
        w_used: float,
        promote_seconds: float,
        w_miss: float,
        extra_probes: int,
        loads: dict[Hashable, WorkerLoad],
        randrange: Callable[[int], int],
    ) -> None: ...
    def add(self, worker: Hashable, /) -> None: ...
    def remove(self, worker: Hashable, /) -> None: ...
    def advance(self, now: float, /) -> None: ...
    def report(self, worker: Hashable, load: WorkerLoad, /) -> None: ...
    def add_work(self, worker: Hashable, amount: float, now: float, /) -> None: ...
    def smoothed(self, worker: Hashable, now: float, /) -> float: ...
    def smoothed_mean(self, now: float, /) -> float: ...
    def work(self, worker: Hashable, now: float, /) -> float: ...
    def work_mean(self, now: float, /) -> float: ...
    def over(self, worker: Hashable, now: float, slow: float, cap: float, /) -> bool: ...
    def promote_load(self, worker: Hashable, /) -> float: ...
    def thresholds(
        self,
        num_tokens: int,
        now: float,
        mean_queued: float | None,
        mean_smoothed: float | None,
        mean_work: float | None,
        /,
    ) -> tuple[float, float, float]: ...
    def credit(
        self,
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        host: dict[Hashable, int] | None,
        ahead: dict[Hashable, int] | None,
        /,
    ) -> dict[Hashable, float]: ...
    def scan(
        self,
        credit: dict[Hashable, float],
        among: Container[Hashable],
        limit: float,
        now: float,
        slow: float,
        cap: float,
        w_uncached: float,
        w_spread: float,
        pending: Container[Hashable],
        probes: int,
        /,
    ) -> tuple[float, list[Hashable], list[Hashable], set[Hashable], bool, bool]: ...
    def choose(
        self,
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        host: dict[Hashable, int] | None,
        ahead: dict[Hashable, int] | None,
        pending: Container[Hashable],
        num_tokens: int,
        now: float,
        w_uncached: float,
        w_spread: float,
        guard: bool = True,
        /,
    ) -> tuple[Hashable, str] | None: ...
    def assign(self, worker: Hashable, uncached: int, now: float, /) -> None: ...
    def place(
        self,
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        host: dict[Hashable, int] | None,
        ahead: dict[Hashable, int] | None,
        pending: Container[Hashable],
        num_tokens: int,
        now: float,
        w_uncached: float,
        w_spread: float,
        guard: bool = True,
        /,
    ) -> Decision | None: ...
