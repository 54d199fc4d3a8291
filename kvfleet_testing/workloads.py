"""Shared-prefix request mixes in token ids (lengths exact), for the tests and the benchmarks.

Owns every seeded shared-prefix prompt generator the project uses, built on one token draw
(``random_tokens``), and the unbounded-cache hit rate of a prompt order (``hit_rate_bound``):

- ``SharedPrefixWorkload``: ``num_prefixes`` documents, each asked ``requests_per_prefix``
  questions, shuffled once (the cluster benchmark's shared-prefix mix; ``serve_bench`` sends the
  same shape in text, ``benchmarks/support/serve_workload.py``);
- ``HybridWorkload``: Zipf-popular prefixes cut across block boundaries under cache pressure,
  where exact hybrid hit prediction matters;
- ``shared_prefix_prompts``: short prefixes repeated whole or cut, the P/D stress and chaos mix;
- ``reuse_prompts``: every prefix reused in rounds, each request with its own suffix (the hybrid
  capacity benchmark's hit sweep).

Invariants: the same arguments give the same prompts (one ``random.Random`` per call, seeded
from the arguments); every draw of a token goes through ``random_tokens``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass


def random_tokens(rng: random.Random, count: int, low: int, high: int) -> list[int]:
    """``count`` token ids drawn uniformly from ``[low, high)``."""
    return [rng.randrange(low, high) for _ in range(count)]


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """The shared-prefix request mix: ``num_prefixes`` documents of ``prefix_tokens`` tokens, each
    asked ``requests_per_prefix`` questions of ``suffix_tokens`` tokens, in a shuffled order,
    ``concurrency`` requests in flight; ``cache_fraction`` sizes the workers' pools
    (``kvfleet_testing.sizing.sized_config``)."""

    num_prefixes: int = 8
    requests_per_prefix: int = 16
    prefix_tokens: int = 256
    suffix_tokens: int = 16
    max_tokens: int = 8
    concurrency: int = 4
    cache_fraction: float = 0.5
    warmup: int = 2
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        low, high = min(3, vocab_size - 1), vocab_size
        prefixes = [random_tokens(rng, self.prefix_tokens, low, high) for _ in range(self.num_prefixes)]
        prompts = [
            prefix + random_tokens(rng, self.suffix_tokens, low, high)
            for prefix in prefixes
            for _ in range(self.requests_per_prefix)
        ]
        rng.shuffle(prompts)
        return prompts

    def warmup_prompts(self, vocab_size: int) -> list[list[int]]:
        return warmup_prompts(self.seed, self.warmup, self.suffix_tokens + 4, vocab_size)


@dataclass(frozen=True)
class HybridWorkload:
    """A request mix where exact hybrid hit prediction matters: cache pressure above capacity, so
    prefixes lose their sliding-window blocks or Mamba states while their full-attention blocks
    stay, and shared/unique splits swept across block boundaries.

    - ``num_prefixes`` documents with Zipf popularity (exponent ``zipf``): popular ones stay warm,
      the tail is revisited after the pool has turned over, so a worker often still holds the head
      of such a prefix (full attention, freed last: a request frees its blocks tail first) but not
      the window at its end or the Mamba state there;
    - each request shares ``prefix_tokens - offset`` tokens of its document, ``offset`` drawn from
      0..``sweep_tokens`` (about two blocks), then ``suffix_tokens`` unique tokens: the shared part
      ends on and off block boundaries, where sliding-window and Mamba hits differ from the
      full-attention depth;
    - the pools are sized to ``cache_fraction`` (< 1) of the prefix set plus room for the requests
      in flight (``kvfleet_testing.sizing.sized_config``), and ``flood_share`` of the requests are
      unique prompts that push cached blocks out.

    An approximate router that remembers where it sent each prefix believes such a worker holds
    the whole prefix (a false hit); kvfleet's router predicts the hit the worker's coordinator will
    find, by the same per-group rules."""

    num_prefixes: int = 16
    num_requests: int = 96
    prefix_tokens: int = 256
    suffix_tokens: int = 24
    sweep_tokens: int = 32
    flood_share: float = 0.15
    zipf: float = 1.0
    max_tokens: int = 8
    concurrency: int = 4
    cache_fraction: float = 0.35
    warmup: int = 2
    seed: int = 0

    @property
    def requests_per_prefix(self) -> int:
        return max(1, self.num_requests // max(1, self.num_prefixes))

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        low, high = min(3, vocab_size - 1), vocab_size
        prefixes = [random_tokens(rng, self.prefix_tokens, low, high) for _ in range(self.num_prefixes)]
        weights = [1.0 / (k + 1) ** self.zipf for k in range(self.num_prefixes)]
        out = []
        for _ in range(self.num_requests):
            if rng.random() < self.flood_share:  # a unique prompt of the same length: pressure only
                out.append(random_tokens(rng, self.prefix_tokens + self.suffix_tokens, low, high))
                continue
            k = rng.choices(range(self.num_prefixes), weights)[0]
            cut = self.prefix_tokens - rng.randint(0, min(self.sweep_tokens, self.prefix_tokens - 1))
            out.append(prefixes[k][:cut] + random_tokens(rng, self.suffix_tokens, low, high))
        return out

    def warmup_prompts(self, vocab_size: int) -> list[list[int]]:
        return warmup_prompts(self.seed, self.warmup, self.suffix_tokens + 4, vocab_size)


def warmup_prompts(seed: int, count: int, length: int, vocab_size: int) -> list[list[int]]:
    """``count`` short unrelated prompts a run sends before it measures (seeded by ``seed + 1``)."""
    rng = random.Random(seed + 1)
    return [random_tokens(rng, length, 3, vocab_size) for _ in range(count)]


def shared_prefix_prompts(seed: int, count: int, num_prefixes: int = 4) -> list[list[int]]:
    """``count`` prompts over ``num_prefixes`` prefixes (60-110 tokens): a third exact repeats
    of a prefix plus its short tail, the rest a cut of a prefix (at least half of it) plus a new
    suffix of 1-24 tokens."""
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, rng.randrange(60, 111), 3, 250) for _ in range(num_prefixes)]
    tails = [random_tokens(rng, rng.randrange(1, 9), 3, 250) for _ in range(num_prefixes)]
    prompts = []
    for _ in range(count):
        k = rng.randrange(num_prefixes)
        if rng.random() < 1 / 3:
            prompts.append(prefixes[k] + tails[k])
        else:
            cut = rng.randrange(len(prefixes[k]) // 2, len(prefixes[k]) + 1)
            prompts.append(prefixes[k][:cut] + random_tokens(rng, rng.randrange(1, 25), 3, 250))
    return prompts


def reuse_prompts(shared: int, unique: int, prefixes: int, reuse: int, seed: int) -> list[list[int]]:
    """``prefixes`` prefixes of ``shared`` tokens, each sent ``reuse`` times in rounds (every prefix
    once per round), each request with ``unique`` tokens of its own: a marker token (30000 + its
    index, outside the prefixes' range) then random ones."""
    rng = random.Random(seed)
    heads = [random_tokens(rng, shared, 0, 30000) for _ in range(prefixes)]
    order = [p for _ in range(reuse) for p in range(prefixes)]
    return [heads[p] + [30000 + i] + random_tokens(rng, unique - 1, 0, 30000) for i, p in enumerate(order)]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return len(os.path.commonprefix([list(a), list(b)]))  # noqa: RUF071 - element-wise prefix of two token lists, not paths


def hit_rate_bound(prompts: list[list[int]], alignment: int) -> float:
    """The token hit rate no router can beat on ``prompts`` in this order: every request finds,
    in an unbounded cache, the longest prefix it shares with any earlier request (whole
    ``alignment``-token steps, at most its length - 1, as the engine looks up). The gap between a
    policy's hit rate and this bound is what cache capacity and placement cost it."""
    hit = total = 0
    seen: list[list[int]] = []
    for prompt in prompts:
        best = min(max((common_prefix_length(prompt, e) for e in seen), default=0), len(prompt) - 1)
        hit += best - best % alignment
        total += len(prompt)
        seen.append(prompt)
    return hit / total if total else 0.0
