"""KV-cache specs: what one group of layers keeps per block, and which of its tokens it still needs.

A *group* is a set of layers sharing one block table. Every spec answers two questions the
managers need: its block size, and ``skipped_tokens(n)`` — how many leading tokens' KV are no
longer needed to compute token ``n`` once ``n`` tokens are computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd, lcm
from typing import Literal


@dataclass(frozen=True)
class FullAttentionSpec:
    """Full causal attention: every token's KV is needed forever."""

    block_size: int
    page_bytes: int = 0

    def skipped_tokens(self, num_computed: int) -> int:
        return 0


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Sliding-window attention: token q attends keys in (q - window, q] (the window includes q)."""

    block_size: int
    window: int
    page_bytes: int = 0

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1)

    @property
    def blocks_for_hit(self) -> int:
        """Contiguous cached blocks a hit needs at its end: the window minus the current token."""
        return -(-(self.window - 1) // self.block_size)


@dataclass(frozen=True)
class ChunkedLocalSpec:
    """Chunked local attention: tokens attend only within their chunk of ``chunk_size`` tokens."""

    block_size: int
    chunk_size: int
    page_bytes: int = 0

    def skipped_tokens(self, num_computed: int) -> int:
        return (num_computed // self.chunk_size) * self.chunk_size


@dataclass(frozen=True)
class MambaSpec:
    """A recurrent (Mamba/SSM) state: one state per request; in "align" mode a state is cached
    whenever the computed length lands on a block boundary (block index i holds the state after
    ``(i + 1) * block_size`` tokens)."""

    block_size: int
    mode: Literal["align"] = "align"
    page_bytes: int = 0

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - 1)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalSpec | MambaSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """One block table's worth of layers and the spec they share.

    ``pool`` is the index of the block pool the group draws its blocks from (one pool per page
    size; pools are numbered 0..P-1 and the coordinator requires every index to be used). The
    group's block ids are ids in that pool.
    """

    spec: KVCacheSpec
    layer_names: tuple[str, ...] = ()
    pool: int = 0


def hash_block_size(groups: list[KVCacheGroup]) -> int:
    """Granularity of request block hashes: the GCD of the groups' block sizes."""
    size = 0
    for group in groups:
        size = gcd(size, group.spec.block_size)
    return size


def alignment_tokens(groups: list[KVCacheGroup]) -> int:
    """Hit lengths and cache boundaries align to the LCM of the groups' block sizes."""
    return lcm(*(group.spec.block_size for group in groups))
