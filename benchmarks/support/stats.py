"""The one percentile every benchmark reports (``percentile``).

Nearest rank: the value at index ``floor(q * n)`` of the sorted values (clamped to the last), no
interpolation, 0.0 for no values. The routing simulation's TTFT and decision-time percentiles
have always been taken this way; the cluster, P/D and serving benchmarks report measured wall
times, which move run to run by more than the difference to an interpolated percentile.
"""

from __future__ import annotations

from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1) of ``values`` by nearest rank; 0.0 when there are none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
