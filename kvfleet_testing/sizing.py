"""A cluster config sized for a workload, from the KV groups its workers will have.

Owns the sizing rule the cluster benchmark, the route replay and the hybrid routing tests share:
each worker's pool holds ``cache_fraction`` of the workload's whole prefix set plus room for its
requests in flight (``sized_config``), counted in blocks by the coordinator's own per-group hit
rules (``blocks_for``), on the groups read from the model's config.json (``kv_groups``).
Invariants: a ``cache_fraction`` of 0 or less leaves the config as it is; the pin budget never
exceeds the sized pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from configs import ClusterConfig

if TYPE_CHECKING:
    from engine.kv_cache import KVCacheGroup


class SizedWorkload(Protocol):
    """What sizing reads of a workload (``SharedPrefixWorkload`` and ``HybridWorkload`` have it)."""

    @property
    def num_prefixes(self) -> int: ...
    @property
    def prefix_tokens(self) -> int: ...
    @property
    def suffix_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def cache_fraction(self) -> float: ...


def blocks_for(groups: list[KVCacheGroup], num_tokens: int) -> int:
    """Blocks a cached prefix of ``num_tokens`` keeps in the pool across ``groups``: what a hit at
    its last whole block needs, by the coordinator's own per-group rules (full attention: every
    block; sliding window: the window's; Mamba: one state)."""
    from engine.routing import HitRules

    rules = HitRules(groups)
    total = 0
    for manager in rules.managers:
        aligned = max(num_tokens - num_tokens % manager.block_size, manager.block_size)
        needed = manager.blocks_needed_at(aligned)
        total += needed.stop - needed.start
    return total


def sized_config(config: ClusterConfig, workload: SizedWorkload, groups: list[KVCacheGroup]) -> ClusterConfig:
    """``config`` with every worker's pool sized to ``cache_fraction`` of the prefix set plus room
    for the requests in flight on one worker (``cache_fraction`` 0: the config's own size)."""
    if workload.cache_fraction <= 0:
        return config
    prompt_tokens = workload.prefix_tokens + workload.suffix_tokens + workload.max_tokens
    in_flight = -(-workload.concurrency // max(1, config.workers.num_prefill))
    prefix_set = workload.num_prefixes * blocks_for(groups, workload.prefix_tokens)
    num_blocks = int(workload.cache_fraction * prefix_set) + in_flight * blocks_for(groups, prompt_tokens) + 1
    pinning = config.kv_cache.pinning
    if pinning.budget_blocks is not None and pinning.budget_blocks > num_blocks:
        pinning = pinning.model_copy(update={"budget_blocks": num_blocks})
    kv = config.kv_cache.model_copy(update={"num_blocks": num_blocks, "memory_budget_mib": None, "pinning": pinning})
    return config.model_copy(update={"kv_cache": kv})


def kv_groups(config: ClusterConfig) -> list[KVCacheGroup]:
    """The KV-cache groups the config's workers will have (read from the model's config.json)."""
    from engine.core import resolve_model_directory
    from engine.model.arch.hf_config import arch_from_hf_config
    from engine.model.checkpoints.loader import read_hf_config
    from engine.model.kv_layout import build_kv_layout

    hf_config = read_hf_config(resolve_model_directory(config))
    arch = arch_from_hf_config(hf_config, config.model.sliding_window_override)
    dtype = config.model.resolved_dtype
    return list(build_kv_layout(arch, config.kv_cache.block_size, dtype).groups)


def vocab_size(config: ClusterConfig) -> int:
    """The vocabulary of the config's model (read from its config.json), which token-id
    workloads draw from as the cluster's ``vocab_size`` does."""
    from engine.core import resolve_model_directory
    from engine.model.checkpoints.loader import read_hf_config

    return int(read_hf_config(resolve_model_directory(config))["vocab_size"])
