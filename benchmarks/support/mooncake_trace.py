"""Mooncake-format request traces turned into the placement simulation's ``Trace``.

Owns ``load_requests`` (the JSONL rows, optionally a time window of them) and ``build_trace``:
each hash id becomes its own deterministic tokens (``512 // scale`` of them, seeded by the id),
a request's prompt is its blocks' tokens truncated to ``input_length // scale``, and the worker
pool is sized so the cluster's device KV holds ``ratio`` of the trace's working set. Every
request is its own "prefix" entry of the ``Trace`` (empty suffix), so the simulation's records
count whole prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.support.routing_trace import BLOCK, CHUNK, GROUPS, Arrival, Trace
from engine.kv_cache import KVCacheGroup
from engine.kv_cache.hashing import extend_block_hashes

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake format
VOCAB = 32000


@dataclass(frozen=True)
class TraceRow:
    """One trace request: arrival (seconds from the first kept row), lengths in tokens, hash ids."""

    time: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_requests(path: Path, start_s: float = 0.0, window_s: float | None = None) -> list[TraceRow]:
    """The rows whose timestamp lies in ``[start_s, start_s + window_s)`` (all after ``start_s``
    when ``window_s`` is None), times shifted so the first kept row arrives at 0."""
    rows = []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            raw = json.loads(line)
            t = raw["timestamp"] / 1000.0
            if t < start_s or (window_s is not None and t >= start_s + window_s):
                continue
            rows.append(TraceRow(t, int(raw["input_length"]), int(raw["output_length"]), tuple(raw["hash_ids"])))
    rows.sort(key=lambda r: r.time)
    if rows:
        t0 = rows[0].time
        rows = [TraceRow(r.time - t0, r.input_length, r.output_length, r.hash_ids) for r in rows]
    return rows


def block_tokens(hash_id: int, scale: int) -> list[int]:
    """The tokens of one hash block: ``512 // scale`` ids drawn from a generator seeded by the id."""
    rng = random.Random(hash_id * 1_000_003 + scale)
    return [rng.randrange(1, VOCAB) for _ in range(TRACE_BLOCK // scale)]


def build_trace(
    rows: list[TraceRow], workers: int, ratio: float, scale: int, groups: list[KVCacheGroup] | None = None
) -> Trace:
    """The simulation's trace for ``workers`` workers whose device KV together holds ``ratio`` of
    the distinct hash blocks' tokens (at least what twice the longest prompt needs per worker)."""
    cache: dict[int, list[int]] = {}
    prompts: list[list[int]] = []
    arrivals: list[Arrival] = []
    for i, row in enumerate(rows):
        tokens: list[int] = []
        for h in row.hash_ids:
            if h not in cache:
                cache[h] = block_tokens(h, scale)
            tokens.extend(cache[h])
        n = max(2, min(len(tokens), row.input_length // scale))
        prompts.append(tokens[:n])
        arrivals.append(Arrival(i, row.time, i, (), max(1, row.output_length // scale)))
    working_set_blocks = len(cache) * (TRACE_BLOCK // scale) // BLOCK
    longest = max(len(p) for p in prompts) // BLOCK + 1
    extra = sum(g.spec.blocks_for_hit + CHUNK // BLOCK for g in (groups or GROUPS)[1:])  # type: ignore[union-attr]
    num_blocks = max(int(working_set_blocks * ratio / workers), 2 * (longest + extra))
    duration = max(1e-9, arrivals[-1].time) if arrivals else 1.0
    return Trace(
        workers=workers,
        ratio=ratio,
        prefixes=prompts,
        prefix_hashes=[extend_block_hashes([], p, BLOCK) for p in prompts],
        arrivals=arrivals,
        working_set_blocks=working_set_blocks,
        num_blocks=num_blocks,
        oracle_hit_rate=0.0,
        rate=len(arrivals) / duration,
    )
