"""The simulated fleet of ``benchmarks/router_scale.py``: W workers whose caches send the KV event
stream a real worker sends (stored, evicted, pinned, per group), and the trace that feeds them.

A worker (``FleetWorker``) keeps, per KV-cache group, the hashes it caches and their pin level:
the truth the router's index should mirror, and what the exact oracle (``HitRules.longest_hit``,
the coordinator's own fixed point) reads. Running a prompt caches, in LRU entries:

* the prefix entry (one per shared prefix the worker ran): every full-attention block of the
  prefix, and per sliding-window group the window ending at the prefix boundary (the retention
  anchor a real coordinator keeps there, announced ``BlockPinned(explicit=False)``);
* the request entry: the prompt's own full-attention blocks past the prefix and the windows
  ending at the prompt's last full block.

Blocks are reference-counted across entries; when the worker holds more than ``capacity`` blocks
the least recently used entries go, and blocks no entry holds any more are announced removed.
Every event carries the worker's next sequence number and freshly allocated hash objects (a
router deserialises every worker's events into its own ``bytes``), so the index pays for each
key it keeps.

With a host tier (``host_capacity`` blocks, ``router_scale``'s host-tier scenario), a block the
device evicts is offloaded there (``BlockOffloaded``) unless it already is, the host tier drops
its least recently offloaded blocks past its capacity (``BlockDropped``), and a block a prompt
needs that only the host tier holds is promoted (``BlockPromoted``: back on the device, the host
keeping its copy), as ``engine.kv_cache.host_tier`` does; the exact oracle then reads both tiers
(``HitRules.tiered_hit``).

The workload scales with the fleet: ``prefixes_per_worker * W`` shared prefixes with Zipf
popularity, each worker's cache ``capacity`` blocks, and per decision a fixed number of load
reports (each worker reports about as often whatever W is).
"""

from __future__ import annotations

import pickle
import random
from bisect import bisect
from collections import OrderedDict
from dataclasses import dataclass, replace
from itertools import accumulate

from engine.kv_cache import KVCacheGroup
from engine.kv_cache.events import (
    BlockDropped,
    BlockOffloaded,
    BlockPinned,
    BlockPromoted,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from engine.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from engine.routing.hit_rules import HitRules

BLOCK = 16
GROUPS = [
    KVCacheGroup(FullAttentionSpec(BLOCK)),
    KVCacheGroup(SlidingWindowSpec(BLOCK, window=128)),
    KVCacheGroup(SlidingWindowSpec(BLOCK, window=512)),
]
WINDOW_BLOCKS = (0, 128 // BLOCK, 512 // BLOCK)  # per group: blocks a window keeps (0: full attention)


@dataclass(frozen=True)
class Request:
    """One request of the trace: its prefix rank, chained block hashes and token count."""

    index: int
    prefix: int
    block_hashes: list[bytes]
    num_tokens: int


def make_prefixes(count: int, rng: random.Random, min_tokens: int, max_tokens: int) -> list[list[bytes]]:
    """``count`` shared prefixes as chained block hashes (random 32-byte values: the index only
    compares them), each a whole number of blocks."""
    out = []
    for _ in range(count):
        blocks = rng.randint(min_tokens // BLOCK, max_tokens // BLOCK)
        out.append([rng.randbytes(32) for _ in range(blocks)])
    return out


def make_requests(
    prefixes: list[list[bytes]], count: int, alpha: float, rng: random.Random, suffix: tuple[int, int]
) -> list[Request]:
    """``count`` requests: a Zipf(``alpha``) prefix and a unique suffix of ``suffix`` tokens."""
    weights = [1.0 / (rank + 1) ** alpha for rank in range(len(prefixes))]
    cumulative = list(accumulate(weights))
    out = []
    for i in range(count):
        rank = min(len(prefixes) - 1, bisect(cumulative, rng.random() * cumulative[-1]))
        tail = rng.randint(*suffix)
        num_tokens = len(prefixes[rank]) * BLOCK + tail
        hashes = prefixes[rank] + [rng.randbytes(32) for _ in range(tail // BLOCK)]
        out.append(Request(i, rank, hashes, num_tokens))
    return out


def warm_requests(prefixes: list[list[bytes]], rng: random.Random, suffix: tuple[int, int]) -> list[Request]:
    """One request per prefix, in rank order (the warm-up runs each on worker ``rank % W``)."""
    out = []
    for rank, prefix in enumerate(prefixes):
        tail = rng.randint(*suffix)
        hashes = prefix + [rng.randbytes(32) for _ in range(tail // BLOCK)]
        out.append(Request(-1 - rank, rank, hashes, len(prefix) * BLOCK + tail))
    return out


class FleetWorker:
    """One simulated worker's prefix cache (see the module docstring) and its event counter.

    Invariants: ``tables[g]`` holds exactly the blocks of group ``g`` some entry holds;
    ``refs[block(g, h)]`` counts those entries; ``len(refs)``, the number of (group, hash) blocks
    cached, stays <= ``capacity`` after each run; ``host_tables[g]`` holds exactly the blocks of
    group ``g`` in ``hosted`` (the host tier, oldest offload first), at most ``host_capacity``
    (0: no host tier) after each run; events are numbered 1, 2, ... without gaps.
    A cached block is one ``bytes`` key (``block``), not a tuple: the simulated caches live in the
    router's process only because this is a simulation, and what they keep must not be objects the
    router's garbage collector traverses (a real router's is not burdened with its workers' caches)."""

    def __init__(self, name: str, capacity: int, host_capacity: int = 0):
        self.name = name
        self.capacity = capacity
        self.host_capacity = host_capacity
        self.tables: list[dict[bytes, int]] = [{} for _ in GROUPS]
        self.host_tables: list[dict[bytes, int]] = [{} for _ in GROUPS]
        self.hosted: OrderedDict[bytes, None] = OrderedDict()
        self.refs: dict[bytes, int] = {}
        self.entries: OrderedDict[object, list[bytes]] = OrderedDict()
        self.seq = 0
        self.queued = 0.0  # prefill-token equivalents waiting on this worker
        self.queued_at = 0.0

    def run(self, request: Request, prefix_blocks: int) -> list[KVEvent]:
        """Cache ``request``'s prompt (prefix entry refreshed, request entry added); its events."""
        hashes = request.block_hashes
        events: list[KVEvent] = []
        key = ("prefix", request.prefix)
        if key in self.entries:
            self.entries.move_to_end(key)
        else:
            self._add(key, _entry_blocks(hashes, prefix_blocks), events, pin_windows=True)
        self._add(("request", request.index), _entry_blocks(hashes, len(hashes), start=prefix_blocks), events)
        self._evict(events)
        return events

    def load(self, now: float, drain_tps: float) -> float:
        self.queued = max(0.0, self.queued - (now - self.queued_at) * drain_tps)
        self.queued_at = now
        return self.queued

    def _add(self, key: object, blocks: list[bytes], events: list[KVEvent], pin_windows: bool = False) -> None:
        stored: list[list[bytes]] = [[] for _ in GROUPS]
        promoted: list[list[bytes]] = [[] for _ in GROUPS]
        for cached in blocks:
            count = self.refs.get(cached, 0)
            self.refs[cached] = count + 1
            if count == 0:
                g, block_hash = cached[0], cached[1:]
                self.tables[g][block_hash] = 0
                (promoted if cached in self.hosted else stored)[g].append(block_hash)
        self.entries[key] = blocks
        for g, new in enumerate(promoted):
            if new:
                self.seq += 1
                events.append(BlockPromoted(self.seq, g, _fresh(new)))
        for g, new in enumerate(stored):
            if new:
                self.seq += 1
                events.append(BlockStored(self.seq, g, _fresh(new)))
        if pin_windows:
            for g in range(1, len(GROUPS)):
                window = [c[1:] for c in blocks if c[0] == g and self.tables[g][c[1:]] == 0]
                if window:
                    for h in window:
                        self.tables[g][h] = 1
                    self.seq += 1
                    events.append(BlockPinned(self.seq, g, _fresh(window), explicit=False))

    def _evict(self, events: list[KVEvent]) -> None:
        while len(self.refs) > self.capacity and len(self.entries) > 1:
            _, blocks = self.entries.popitem(last=False)
            removed: list[list[bytes]] = [[] for _ in GROUPS]
            for cached in blocks:
                count = self.refs[cached] - 1
                if count:
                    self.refs[cached] = count
                else:
                    g, block_hash = cached[0], cached[1:]
                    del self.refs[cached]
                    del self.tables[g][block_hash]
                    removed[g].append(block_hash)
            for g, gone in enumerate(removed):
                if gone:
                    self.seq += 1
                    events.append(BlockRemoved(self.seq, g, _fresh(gone)))
            if self.host_capacity:
                self._offload(removed, events)

    def _offload(self, removed: list[list[bytes]], events: list[KVEvent]) -> None:
        """The device's evicted blocks into the host tier (those it lacks), its oldest past
        ``host_capacity`` dropped."""
        offloaded: list[list[bytes]] = [[] for _ in GROUPS]
        for g, gone in enumerate(removed):
            for block_hash in gone:
                cached = block(g, block_hash)
                if cached not in self.hosted:
                    self.hosted[cached] = None
                    self.host_tables[g][block_hash] = 0
                    offloaded[g].append(block_hash)
        for g, new in enumerate(offloaded):
            if new:
                self.seq += 1
                events.append(BlockOffloaded(self.seq, g, _fresh(new)))
        dropped: list[list[bytes]] = [[] for _ in GROUPS]
        while len(self.hosted) > self.host_capacity:
            cached, _ = self.hosted.popitem(last=False)
            g, block_hash = cached[0], cached[1:]
            del self.host_tables[g][block_hash]
            dropped[g].append(block_hash)
        for g, gone in enumerate(dropped):
            if gone:
                self.seq += 1
                events.append(BlockDropped(self.seq, g, _fresh(gone)))


def block(group: int, block_hash: bytes) -> bytes:
    """A cached (group, hash) block as one key: the group's byte, then the hash."""
    return bytes((group,)) + block_hash


def _entry_blocks(hashes: list[bytes], end: int, start: int = 0) -> list[bytes]:
    """Full-attention blocks [start, end) and each window ending at ``end``."""
    blocks = [block(0, h) for h in hashes[start:end]]
    for g in range(1, len(GROUPS)):
        blocks.extend(block(g, h) for h in hashes[max(0, end - WINDOW_BLOCKS[g]) : end])
    return blocks


def _fresh(hashes: list[bytes]) -> tuple[bytes, ...]:
    """New ``bytes`` objects with the same values (what deserialising an event gives)."""
    return tuple(bytes(bytearray(h)) for h in hashes)


def received(hashes: list[bytes]) -> list[bytes]:
    """A request's hashes as the router actor's ``route`` receives them: deserialised by Ray
    (pickled) right before the call, so the objects are new and in the CPU cache, as in a router."""
    fresh: list[bytes] = pickle.loads(pickle.dumps(hashes, protocol=pickle.HIGHEST_PROTOCOL))
    return fresh


def refreshed(event: KVEvent) -> KVEvent:
    """``event`` with fresh hash objects (what another router replica deserialising the same
    report holds)."""
    hashes = getattr(event, "block_hashes", None)
    return event if hashes is None else replace(event, block_hashes=_fresh(hashes))  # type: ignore[type-var]


def exact_hit(rules: HitRules, worker: FleetWorker, request: Request) -> int:
    """The worker coordinator's own fixed point on the worker's cache, over both tiers where it
    has a host tier (the exact oracle)."""
    host = worker.host_tables if worker.host_capacity else None
    return rules.longest_hit(worker.tables, request.block_hashes, request.num_tokens - 1, False, host)
