"""Turn ``kv_cache.memory_budget_mib`` into blocks per pool of a ``KVLayout`` (no torch here).

The config states memory; this module splits it between the pools:

1. **Running states first.** Every state pool reserves ``max_num_seqs x groups x
   STATES_PER_RUNNING_REQUEST`` blocks (plus its null block): each running request holds one
   state per recurrent group, and in align mode a second, transient one while the state at a
   block boundary is written (a Mamba table holds at most 2 live states:
   ``engine/kv_cache/invariants.py``). A budget that cannot hold them is refused: the scheduler
   would admit requests whose states cannot be allocated.
2. **Cached states, bounded.** What remains is shared between cached recurrent states (one per
   recurrent group for each cached prefix, so a prefix hit can resume the recurrence) and
   attention pages. Cached states get at most ``state_cache_fraction`` of it, but at least
   ``MIN_CACHED_STATES`` while that takes at most half of it (a fraction of 0 keeps none). With
   ``expected_prefix_tokens`` set, they get only as many as the attention pool has prefixes of
   that length (one state per cached prefix; more could never be hit), and the rest goes back
   to attention.
3. **Attention gets the rest**, in ``kv_cache.block_size``-token pages (at least 2 blocks).

How the split follows the workload: the reservation scales with ``scheduler.max_num_seqs`` (the
number of requests that can run at once) and the model's recurrent groups; the cached share
follows ``expected_prefix_tokens`` (set it to the workload's typical shared-prefix length, e.g.
from ``/v1/stats``: shorter prefixes mean more distinct prefixes per attention token, so more
cached states pay off) under the cap ``state_cache_fraction``. The split is fixed when a worker
starts (the pools are allocated once); a restarted worker takes the config's current values.

A single pool (pure attention or pure recurrent models) gets ``budget // block_bytes`` blocks,
as before pools existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.model.kv_layout import KVLayout

if TYPE_CHECKING:
    from configs.schema import KVCacheConfig

#: blocks a running request holds per recurrent group in align mode: its state, and the one being
#: written at a block boundary
STATES_PER_RUNNING_REQUEST = 2

#: cached states a hybrid split keeps at least (when ``state_cache_fraction`` > 0 and half of what
#: the running states leave can hold them): every request caches a state at each prefill chunk end,
#: so fewer are churned out before the next request of a prefix arrives (Bamba-9B at 8 GiB: the
#: 2 states of 5% gave 0 hits in benchmarks/hybrid_capacity.py's sweep)
MIN_CACHED_STATES = 8


@dataclass(frozen=True)
class BudgetSplit:
    """Blocks per pool for one budget, and what the budget went to (bytes).

    Invariant: ``reserved_bytes + cached_state_bytes + attention_bytes <= budget_bytes`` and
    every state pool holds at least the running requests' reservation.
    """

    num_blocks: tuple[int, ...]
    budget_bytes: int
    reserved_bytes: int
    cached_state_bytes: int
    attention_bytes: int
    cached_states: int


def split_budget(
    layout: KVLayout,
    budget_bytes: int,
    max_num_seqs: int,
    state_cache_fraction: float = 0.05,
    expected_prefix_tokens: int | None = None,
) -> BudgetSplit:
    """Blocks per pool for ``budget_bytes``; see the module docstring for the rule.

    Raises ValueError when the budget cannot hold the running requests' recurrent states.
    """
    if not 0.0 <= state_cache_fraction < 1.0:
        raise ValueError(f"state_cache_fraction: must be in [0, 1) (got {state_cache_fraction})")
    pools = layout.pools
    if len(pools) == 1:
        blocks = max(2, budget_bytes // pools[0].block_bytes)
        used = blocks * pools[0].block_bytes
        attention_bytes = used if pools[0].kind == "attention" else 0
        return BudgetSplit((blocks,), budget_bytes, used - attention_bytes, 0, attention_bytes, 0)
    state_pools = [p for p, pool in enumerate(pools) if pool.kind == "state"]
    reserved = {p: max_num_seqs * len(layout.groups_in(p)) * STATES_PER_RUNNING_REQUEST + 1 for p in state_pools}
    reserved_bytes = sum(reserved[p] * pools[p].block_bytes for p in state_pools)
    if reserved_bytes > budget_bytes:
        raise ValueError(
            f"kv_cache.memory_budget_mib: {budget_bytes / 2**20:.1f} MiB cannot hold the recurrent states of "
            f"scheduler.max_num_seqs={max_num_seqs} running requests ({reserved_bytes / 2**20:.1f} MiB); "
            "raise the budget or lower max_num_seqs"
        )
    rest = budget_bytes - reserved_bytes
    state_bytes = sum(len(layout.groups_in(p)) * pools[p].block_bytes for p in state_pools)  # one cached state
    attention = layout.attention_pool
    if attention is None:  # only recurrent pools: every block beyond the reservation caches states
        cached = rest // state_bytes
    else:
        pool = pools[attention]
        token_bytes = pool.block_bytes * len(layout.groups_in(attention)) / layout.block_size
        cached = int(state_cache_fraction * rest) // state_bytes
        if state_cache_fraction > 0:
            cached = max(cached, min(MIN_CACHED_STATES, rest // 2 // state_bytes))
        if expected_prefix_tokens:
            prefixes = rest / (token_bytes * expected_prefix_tokens + state_bytes)
            cached = min(cached, int(prefixes) + 1)
    counts = [0] * len(pools)
    for p in state_pools:
        counts[p] = reserved[p] + cached * len(layout.groups_in(p))
    cached_bytes = cached * state_bytes
    attention_bytes = 0
    if attention is not None:
        counts[attention] = max(2, (rest - cached_bytes) // pools[attention].block_bytes)
        attention_bytes = counts[attention] * pools[attention].block_bytes
    return BudgetSplit(tuple(counts), budget_bytes, reserved_bytes, cached_bytes, attention_bytes, cached)


def blocks_per_pool(
    layout: KVLayout, cache: KVCacheConfig, max_num_seqs: int, gpu_budget_bytes: int | None = None
) -> tuple[int, ...]:
    """Blocks per pool for a worker: ``kv_cache.num_blocks`` for every pool, or the split
    (``split_budget`` with the config's fraction and prefix length) of ``kv_cache.memory_budget_mib``
    or, with ``kv_cache.gpu_memory_utilization``, of ``gpu_budget_bytes`` (what the GPU has free,
    engine/model/gpu_memory.py)."""
    if cache.num_blocks:
        return (cache.num_blocks,) * layout.num_pools
    if cache.gpu_memory_utilization is not None:
        if gpu_budget_bytes is None:
            raise ValueError("kv_cache.gpu_memory_utilization: the GPU's free memory was not measured")
        budget = gpu_budget_bytes
    else:
        assert cache.memory_budget_mib is not None  # the schema requires one of the three
        budget = int(cache.memory_budget_mib * 2**20)
    split = split_budget(layout, budget, max_num_seqs, cache.state_cache_fraction, cache.expected_prefix_tokens)
    return split.num_blocks
