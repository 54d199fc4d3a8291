"""A request mix where exact hybrid hit prediction matters (issue 16): cache pressure above
capacity, so prefixes lose their sliding-window blocks or Mamba states while their
full-attention blocks stay, and shared/unique splits swept across block boundaries.

How it gets there:
- ``num_prefixes`` documents with Zipf popularity (exponent ``zipf``): popular ones stay warm,
  the tail is revisited after the pool has turned over, so a worker often still holds the head
  of such a prefix (full attention, freed last: a request frees its blocks tail first) but not
  the window at its end or the Mamba state there;
- each request shares ``prefix_tokens - offset`` tokens of its document, ``offset`` drawn from
  0..``sweep_tokens`` (about two blocks), then ``suffix_tokens`` unique tokens: the shared part
  ends on and off block boundaries, where sliding-window and Mamba hits differ from the
  full-attention depth;
- the pools are sized to ``cache_fraction`` (< 1) of the prefix set plus room for the requests
  in flight (``cluster.bench.sized_config``), and ``flood_share`` of the requests are unique
  prompts that push cached blocks out.

An approximate router that remembers where it sent each prefix believes such a worker holds the
whole prefix (a false hit); kvfleet's router predicts the hit the worker's coordinator will
find, by the same per-group rules.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class HybridWorkload:
    """The hybrid-pressure request mix (token-id prompts, so lengths are exact)."""

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
        low, high = min(3, vocab_size - 1), vocab_size - 1
        prefixes = [[rng.randint(low, high) for _ in range(self.prefix_tokens)] for _ in range(self.num_prefixes)]
        weights = [1.0 / (k + 1) ** self.zipf for k in range(self.num_prefixes)]
        out = []
        for _ in range(self.num_requests):
            if rng.random() < self.flood_share:  # a unique prompt of the same length: pressure only
                out.append([rng.randint(low, high) for _ in range(self.prefix_tokens + self.suffix_tokens)])
                continue
            k = rng.choices(range(self.num_prefixes), weights)[0]
            cut = self.prefix_tokens - rng.randint(0, min(self.sweep_tokens, self.prefix_tokens - 1))
            out.append(prefixes[k][:cut] + [rng.randint(low, high) for _ in range(self.suffix_tokens)])
        return out

    def warmup_prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed + 1)
        return [[rng.randint(3, vocab_size - 1) for _ in range(self.suffix_tokens + 4)] for _ in range(self.warmup)]
