"""Route decisions counted by reason and outcome, so misrouting shows in the router's stats.

For each decision reason (``prefix``, ``cost``, ``guard``, ``pin``, ``inflight``, ``decode_only``,
a baseline's own reasons) three counts: ``hit`` (the chosen worker was predicted to hold part of
the prompt), ``miss`` (it was not), and ``below_best`` (another worker that could have prefilled
it was predicted to hold more: a placement that chose to recompute; ``Decision.best_hit``). A
warmed prefix routed to a cold worker shows as ``miss`` and ``below_best`` under its reason.
"""

from __future__ import annotations

from collections import Counter

from engine.routing.types import Decision

OUTCOMES = ("hit", "miss", "below_best")


class RouteOutcomes:
    """Counts of route decisions per (reason, outcome); see the module docstring."""

    def __init__(self) -> None:
        self._counts: dict[str, Counter[str]] = {}

    def record(self, decision: Decision) -> None:
        counts = self._counts.get(decision.reason)
        if counts is None:
            counts = self._counts[decision.reason] = Counter()
        counts["hit" if decision.predicted_hit > 0 else "miss"] += 1
        if decision.predicted_hit < decision.best_hit:
            counts["below_best"] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{reason: {"hit": n, "miss": n, "below_best": n}}`` (every outcome present)."""
        return {reason: {o: counts[o] for o in OUTCOMES} for reason, counts in sorted(self._counts.items())}
