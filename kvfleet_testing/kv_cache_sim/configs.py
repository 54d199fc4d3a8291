"""Simulator configurations: the group mixes (``MIXES``, ``MIX_POOLS``), ``SimConfig`` and the
sizing rules (``max_len_for``, ``min_pool_blocks_for``, ``min_blocks_for``, ``random_pool_sizes``)
and ``random_config`` that draws one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.kv_cache import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheGroup,
    MambaSpec,
    RetentionOptions,
    SlidingWindowSpec,
)
from engine.kv_cache.spec import alignment_tokens
from kvfleet_testing.kv_cache_sim.records import cdiv

MAX_LEN_CAP = 96


# -- configurations ----------------------------------------------------------------------------------
MIXES: dict[str, tuple] = {
    "full": (FullAttentionSpec(4),),
    "full8": (FullAttentionSpec(8),),
    "full+full8": (FullAttentionSpec(4), FullAttentionSpec(8)),
    "full+swa": (FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
    "full8+swa4": (FullAttentionSpec(8), SlidingWindowSpec(4, 12)),
    "full6+swa4": (FullAttentionSpec(6), SlidingWindowSpec(4, 10)),  # hash unit 2, alignment 12
    "full+swa6+swa13": (FullAttentionSpec(4), SlidingWindowSpec(4, 6), SlidingWindowSpec(4, 13)),
    "full+mamba": (FullAttentionSpec(4), MambaSpec(4)),
    "full4+mamba8": (FullAttentionSpec(4), MambaSpec(8)),
    "full8+mamba4": (FullAttentionSpec(8), MambaSpec(4)),  # Mamba states only hit at multiples of 8
    "full+swa+mamba": (FullAttentionSpec(4), SlidingWindowSpec(4, 8), MambaSpec(4)),
    "full+chunked": (FullAttentionSpec(4), ChunkedLocalSpec(4, 8)),
    "swa": (SlidingWindowSpec(4, 7),),
    # several block pools (one per page size): a block id names a block of its group's pool
    "3pool:full|swa|mamba": (FullAttentionSpec(4), SlidingWindowSpec(4, 8), MambaSpec(4)),
    "2pool:full+full8|mamba8": (FullAttentionSpec(4), FullAttentionSpec(8), MambaSpec(8)),
    "2pool:full8|swa4+chunked": (FullAttentionSpec(8), SlidingWindowSpec(4, 12), ChunkedLocalSpec(4, 8)),
}
# The pool each group of a mix draws from (mixes not listed: every group in pool 0).
MIX_POOLS: dict[str, tuple[int, ...]] = {
    "3pool:full|swa|mamba": (0, 1, 2),
    "2pool:full+full8|mamba8": (0, 0, 1),
    "2pool:full8|swa4+chunked": (0, 1, 1),
}


def mix_pools(mix: str) -> tuple[int, ...]:
    return MIX_POOLS.get(mix, (0,) * len(MIXES[mix]))


def num_pools(mix: str) -> int:
    return max(mix_pools(mix)) + 1


@dataclass(frozen=True)
class SimConfig:
    """A simulator configuration: a mix of ``MIXES``, its pool sizes (an int: that size for every
    pool of the mix; a tuple: one size per pool, in pool order), caching, retention, events, the
    token vocabulary and the seed of the shared base sequences. Frozen: a run's configuration never
    changes; ``groups`` and ``pool_sizes`` derive from it."""

    mix: str
    num_blocks: int | tuple[int, ...]  # an int: that many blocks in every pool
    enable_caching: bool = True
    retention: RetentionOptions = RetentionOptions()  # noqa: RUF009 - frozen, so one shared default is safe
    enable_events: bool = True
    vocab: int = 4
    seed: int = 0  # base sequences (shared prompt prefixes)

    @property
    def groups(self) -> list[KVCacheGroup]:
        return [KVCacheGroup(spec, pool=p) for spec, p in zip(MIXES[self.mix], mix_pools(self.mix), strict=False)]

    @property
    def pool_sizes(self) -> tuple[int, ...]:
        if isinstance(self.num_blocks, int):
            return (self.num_blocks,) * num_pools(self.mix)
        return self.num_blocks

    def describe(self) -> str:
        r = self.retention
        ret = f"retention(budget={r.budget_blocks}, swa={r.pin_sliding_window}, min_drop={r.min_drop_blocks})"
        return (
            f"SimConfig(mix={self.mix!r}, num_blocks={self.num_blocks}, enable_caching={self.enable_caching}, "
            f"{ret if r.enabled else 'no retention'}, events={self.enable_events}, vocab={self.vocab}, "
            f"seed={self.seed})"
        )


def _blocks_alone(specs: tuple, length: int) -> int:
    """Worst-case blocks one request of ``length`` tokens holds alone (a chunk may span it all)."""
    total = 0
    for spec in specs:
        total += 3 if isinstance(spec, MambaSpec) else cdiv(length, spec.block_size)
    return total


def _pool_specs(mix: str) -> list[tuple]:
    """The specs of each pool of a mix, in pool order."""
    pools = mix_pools(mix)
    return [tuple(s for s, q in zip(MIXES[mix], pools, strict=False) if q == p) for p in range(num_pools(mix))]


def max_len_for(mix: str, num_blocks: int | tuple[int, ...]) -> int:
    """Longest request (prompt + output) that fits every pool alone, capped at MAX_LEN_CAP."""
    per_pool = _pool_specs(mix)
    sizes = (num_blocks,) * len(per_pool) if isinstance(num_blocks, int) else num_blocks
    length = 1
    while length < MAX_LEN_CAP and all(
        _blocks_alone(specs, length + 1) <= n - 1 for specs, n in zip(per_pool, sizes, strict=False)
    ):
        length += 1
    return length


def min_pool_blocks_for(mix: str) -> tuple[int, ...]:
    """Per pool, the smallest size in which one request can reach a few alignment units."""
    groups = [KVCacheGroup(s) for s in MIXES[mix]]
    length = 3 * alignment_tokens(groups) + 1
    return tuple(_blocks_alone(specs, length) + 1 for specs in _pool_specs(mix))


def min_blocks_for(mix: str) -> int:
    """Smallest size that fits every pool of the mix (see ``min_pool_blocks_for``)."""
    return max(min_pool_blocks_for(mix))


def random_pool_sizes(rng: random.Random, mix: str) -> tuple[int, ...]:
    """Pools of different sizes, each at least what one request needs alone."""
    return tuple(rng.randint(max(4, low), max(4, low) + rng.choice([0, 4, 16, 40])) for low in min_pool_blocks_for(mix))


def random_config(rng: random.Random, mixes: list[str] | None = None) -> SimConfig:
    """A random configuration over ``mixes`` (default: every mix); several pools get random,
    different-sized pools."""
    mix = rng.choice(sorted(mixes or MIXES))
    num_blocks: int | tuple[int, ...]
    if num_pools(mix) > 1:
        num_blocks = random_pool_sizes(rng, mix)
    else:
        low = max(12, min_blocks_for(mix))
        num_blocks = rng.randint(low, max(low, 64))
    retention = RetentionOptions()
    if rng.random() < 0.5:
        retention = RetentionOptions(
            enabled=True,
            budget_blocks=rng.choice([None, 1, 2, 4, 8]),
            pin_sliding_window=rng.random() < 0.85,
            min_drop_blocks=rng.choice([1, 1, 2]),
        )
    return SimConfig(
        mix=mix,
        num_blocks=num_blocks,
        enable_caching=rng.random() < 0.93,
        retention=retention,
        enable_events=rng.random() < 0.9,
        vocab=rng.choice([2, 3, 4, 4]),
        seed=rng.randrange(1 << 30),
    )
