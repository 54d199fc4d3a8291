"""The trace of ``benchmarks/routing_sim.py``: its prefixes, arrivals and per-scenario cache size.

Owns the simulated workers' KV layout (``BLOCK``, ``CHUNK``, ``GROUPS``), the seeded shared
prefixes (``make_prefixes``) and one (W, ratio) scenario's trace (``make_trace``: Zipf picks,
Poisson arrivals at ``--load`` times the static oracle's capacity, the per-worker block count
sized from the working set, the static oracle's hit rate).
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
from bisect import bisect
from dataclasses import dataclass

from engine.kv_cache import KVCacheGroup
from engine.kv_cache.hashing import extend_block_hashes
from engine.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from engine.routing import HitRules
from kvfleet_testing.workloads import random_tokens

BLOCK = 16
CHUNK = 512
GROUPS = [
    KVCacheGroup(FullAttentionSpec(BLOCK)),
    KVCacheGroup(SlidingWindowSpec(BLOCK, window=128)),
    KVCacheGroup(SlidingWindowSpec(BLOCK, window=512)),
]


# -- trace --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    """One request of the trace: when it arrives, its prefix (rank), unique suffix and output length."""

    index: int
    time: float
    prefix: int
    suffix: tuple[int, ...]
    output: int


@dataclass
class Trace:
    """One (W, ratio) scenario: its arrivals, cache size per worker, static-oracle hit rate and rate."""

    workers: int
    ratio: float
    prefixes: list[list[int]]
    prefix_hashes: list[list[bytes]]
    arrivals: list[Arrival]
    working_set_blocks: int
    num_blocks: int
    oracle_hit_rate: float
    rate: float


def make_prefixes(args: argparse.Namespace) -> tuple[list[list[int]], list[list[bytes]]]:
    rng = random.Random(args.seed)
    prefixes = [
        random_tokens(rng, rng.randint(args.prefix_min, args.prefix_max), 1, 50_000) for _ in range(args.prefixes)
    ]
    return prefixes, [extend_block_hashes([], p, BLOCK) for p in prefixes]


def make_trace(
    args: argparse.Namespace,
    workers: int,
    ratio: float,
    count: int,
    prefixes: list[list[int]],
    prefix_hashes: list[list[bytes]],
) -> Trace:
    """The requests of one (W, ratio) scenario: the same picks for both ratios of a W, arrival
    times scaled to the scenario's rate; the per-worker cache size; the static oracle."""
    rng = random.Random(args.seed * 1000 + workers)
    cum = list(itertools.accumulate((k + 1) ** -args.alpha for k in range(len(prefixes))))
    picks = []
    for _ in range(count):
        rank = bisect(cum, rng.random() * cum[-1])
        suffix = tuple(rng.randrange(50_000, 100_000) for _ in range(rng.randint(args.suffix_min, args.suffix_max)))
        picks.append((rank, suffix, rng.randint(args.output_min, args.output_max), rng.expovariate(1.0)))
    rules = HitRules(GROUPS)
    needed = [len(rules.needed(h, rules.aligned(len(p)))) for p, h in zip(prefixes, prefix_hashes, strict=False)]
    working_set = sum(needed)
    # Blocks one longest request holds while its prompt is built (full prefix, the windows, a chunk).
    longest = (args.prefix_max + args.suffix_max) // BLOCK + sum(
        g.spec.blocks_for_hit + CHUNK // BLOCK
        for g in GROUPS[1:]  # type: ignore[union-attr]
    )
    num_blocks = max(math.ceil(working_set / (ratio * workers)), 2 * longest)
    # Static oracle: the most requested prefixes that fit the cluster's cache are always hit.
    demand = [0] * len(prefixes)
    for rank, _, _, _ in picks:
        demand[rank] += 1
    room = workers * num_blocks
    cached: set[int] = set()
    for rank in sorted(range(len(prefixes)), key=lambda r: -demand[r] * len(prefixes[r]) / needed[r]):
        if demand[rank] and needed[rank] <= room:
            cached.add(rank)
            room -= needed[rank]
    hit = total = 0.0
    work = 0.0
    for rank, suffix, out, _ in picks:
        n = len(prefixes[rank]) + len(suffix)
        h = rules.aligned(len(prefixes[rank])) if rank in cached else 0
        hit += h
        total += n
        work += (n - h) / args.prefill_tps + out / args.decode_tps
    rate = args.load * workers / (work / count)
    t = 0.0
    arrivals = []
    for i, (rank, suffix, out, gap) in enumerate(picks):
        t += gap / rate
        arrivals.append(Arrival(i, t, rank, suffix, out))
    return Trace(workers, ratio, prefixes, prefix_hashes, arrivals, working_set, num_blocks, hit / total, rate)
