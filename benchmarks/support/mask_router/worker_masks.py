"""Worker-bitmask walks over one request's block hashes, for ``engine.routing.index``: the
contiguous depth of every worker at once (``contiguous_depths``), windows of blocks all present
(``sliding_and``) and ANDs over any block range (``RangeAnd``). Pure functions of ints.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import accumulate, repeat
from operator import and_


def contiguous_depths(
    view: Sequence[bytes], limit: int, owners: Mapping[bytes, int], alive: int
) -> list[tuple[int, int]]:
    """Contiguous-prefix depths of a downward-closed (full-attention) group: ``(n, mask)`` pairs,
    ascending in n, where ``mask`` holds the workers whose cached run of ``view`` is exactly ``n``
    blocks (n >= 1, capped at ``limit``).

    ``held[i]`` (the workers holding blocks 0..i-1) is a running AND computed in C; it only ever
    loses workers, so each change point is found by bisection."""
    held = list(accumulate(map(owners.get, view[:limit], repeat(0)), and_, initial=alive))
    stops: list[tuple[int, int]] = []
    end = len(held)
    i = 1
    current = alive
    while current:
        j = bisect_left(held, True, i, end, key=current.__ne__)  # first index no longer == current
        if j == end:
            stops.append((end - 1, current))
            break
        if j > 1:
            stops.append((j - 1, current & ~held[j]))
        current = held[j]
        i = j + 1
    return stops


def sliding_and(values: list[int], width: int) -> list[int]:
    """``out[s]`` = AND of ``values[s : s + width]`` for every full window: per chunk of ``width``
    values a forward and a backward running AND (van Herk / Gil-Werman), then one pass."""
    if width == 1:
        return values
    forward: list[int] = []
    backward: list[int] = []
    for c in range(0, len(values), width):
        chunk = values[c : c + width]
        forward.extend(accumulate(chunk, and_))
        tail = list(accumulate(reversed(chunk), and_))
        tail.reverse()
        backward.extend(tail)
    return [a & b for a, b in zip(backward, forward[width - 1 :], strict=False)]


class RangeAnd:
    """AND of worker bitmasks over any index range of ``present`` (prefix ANDs for ranges from 0,
    a sparse table built level by level on demand for the others)."""

    __slots__ = ("_levels", "_prefix", "present")

    def __init__(self, present: list[int]):
        self.present = present
        self._prefix: list[int] | None = None
        self._levels = [present]

    def all_of(self, start: int, stop: int) -> int:
        if stop <= start:
            return -1  # nothing needed: every worker
        if stop - start == 1:
            return self.present[start]
        if start == 0:
            if self._prefix is None:
                self._prefix = list(accumulate(self.present, and_, initial=-1))
            return self._prefix[stop]
        k = (stop - start).bit_length() - 1
        levels = self._levels
        while len(levels) <= k:
            prev = levels[-1]
            half = 1 << (len(levels) - 1)
            levels.append([a & b for a, b in zip(prev, prev[half:], strict=False)])
        level = levels[k]
        return level[start] & level[stop - (1 << k)]
