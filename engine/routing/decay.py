"""The one rule of an amount that decays with a half-life, read where the routing policy counts
things lately: the work assigned to each worker (``load.DecayedWork``; the compiled load book,
``_load.c``, is its twin) and each prefix's reuse (``prefix_reuse.PrefixReuse``)."""

from __future__ import annotations


def decayed(value: float, at: float, now: float, halflife_s: float) -> float:
    """``value``, recorded at ``at``, as it is at ``now`` once halved every ``halflife_s``
    seconds (unchanged at or before ``at``: time read out of order never grows an amount)."""
    if now <= at:
        return value
    return value * 0.5 ** ((now - at) / halflife_s)
