"""``RandomDriver`` and its operation weights ``OPS``: random operations and arguments for a
``Sim``, one at a time or as a whole scheduler step (shared by the fuzzer and the composite
hypothesis rule).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvfleet_testing.kv_cache_sim.records import LOADING, RUNNING, WAITING
from kvfleet_testing.kv_cache_sim.simulator import Sim

# -- random driver (shared by the fuzzer and the composite hypothesis rule) ------------------------------------------
OPS: dict[str, int] = {
    "arrive": 12,
    "admit": 16,
    "advance": 30,
    "end_step": 12,
    "complete_load": 5,
    "abort": 3,
    "remove_skipped": 3,
    "pin": 3,
    "unpin": 2,
    "reset": 1,
}


class RandomDriver:
    """Draws operations and their arguments from a ``random.Random``."""

    def __init__(self, sim: Sim, rng: random.Random, ops: dict[str, int] | None = None):
        self.sim = sim
        self.rng = rng
        weights = ops or OPS
        self.kinds = list(weights)
        self.cum: list[int] = []
        total = 0
        for kind in self.kinds:
            total += weights[kind]
            self.cum.append(total)
        self.table: dict[str, Callable[[], str]] = {
            "arrive": self.arrive,
            "admit": self.admit,
            "advance": self.advance,
            "end_step": lambda: sim.end_step(rng.randrange(1 << 16)),
            "complete_load": lambda: sim.complete_load(
                rng.randrange(64), rng.choice([0, 0, 0, 0, 1, 2]), rng.randrange(128)
            ),
            "abort": lambda: sim.abort(rng.randrange(64), rng.random() < 0.2),
            "remove_skipped": lambda: sim.remove_skipped(rng.randrange(64), rng.choice([0, 0, 1, 3])),
            "pin": lambda: sim.pin(rng.randrange(64), rng.randrange(128)),
            "unpin": lambda: sim.unpin(rng.randrange(64)),
            "reset": sim.reset,
            "drain": sim.drain,
        }

    def chunk(self) -> int:
        rng = self.rng
        x = rng.random()
        if x < 0.4:
            return 1 << 20
        if x < 0.7:
            return rng.randint(1, 8)
        return rng.randint(1, 40)

    def arrive(self) -> str:
        rng = self.rng
        sim = self.sim
        return sim.arrive(
            source=rng.randrange(64),
            cut=rng.randrange(sim.max_len + 1),
            suffix=[rng.randrange(sim.cfg.vocab) for _ in range(rng.choice([0, 0, 1, 2, 5, 9]))],
            max_tokens=rng.choice([1, 2, 4, 8, 16]),
            remote=rng.random() < 0.2,
            salt=None if rng.random() < 0.85 else "s",
        )

    def admit(self) -> str:
        rng = self.rng
        return self.sim.admit(
            rng.randrange(64),
            ext=0 if rng.random() < 0.6 else rng.randint(1, 40),
            chunk=self.chunk(),
            async_load=rng.random() < 0.6,
            aligned=rng.random() < 0.5,
            reserved=0 if rng.random() < 0.85 else rng.randint(1, 4),
            relookup=rng.random() < 0.5,
        )

    def advance(self) -> str:
        rng = self.rng
        return self.sim.advance(
            rng.randrange(64),
            chunk=self.chunk(),
            aligned=rng.random() < 0.5,
            reserved=0 if rng.random() < 0.9 else rng.randint(1, 3),
            policy=rng.randrange(6),
        )

    def pick(self) -> str:
        x = self.rng.randrange(self.cum[-1])
        for kind, c in zip(self.kinds, self.cum, strict=False):
            if x < c:
                return kind
        return self.kinds[-1]

    def step(self, kind: str | None = None) -> tuple[str, str]:
        """One operation: returns (kind, outcome)."""
        kind = kind or self.pick()
        self.sim.op_index += 1
        return kind, self.table[kind]()

    def scheduler_step(self) -> list[str]:
        """A whole scheduler step the vLLM way: arrivals, running requests first (preempting on
        failure), then admissions until one fails, load completions, then outputs."""
        rng = self.rng
        sim = self.sim
        outcomes = []
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            outcomes.append(self.arrive())  # noqa: PERF401 - one step after another, in the rng's order
        for _ in range(len(sim.live(RUNNING))):
            outcomes.append(self.advance())  # noqa: PERF401 - one step after another, in the rng's order
        for _ in range(len(sim.live(WAITING))):
            out = self.admit()
            outcomes.append(out)
            if out in ("admit_fail", "admit_blocked", "admit_none"):
                break
        for _ in range(len(sim.live(LOADING))):
            if rng.random() < 0.5:
                outcomes.append(sim.complete_load(rng.randrange(64), rng.choice([0, 0, 0, 1, 2]), rng.randrange(128)))  # noqa: PERF401 - one step after another, in the rng's order
        if rng.random() < 0.1:
            outcomes.append(sim.pin(rng.randrange(64), rng.randrange(128)))
        if rng.random() < 0.07:
            outcomes.append(sim.unpin(rng.randrange(64)))
        outcomes.append(sim.end_step(rng.randrange(1 << 16)))
        return outcomes
