"""The KV budget of a CUDA worker from ``kv_cache.gpu_memory_utilization`` (what the GPU has free).

Called once the weights are on the GPU: the worker may hold ``utilization`` of the card's memory
in all; whatever is in use already (the weights, other processes, the CUDA context) and a reserve
for one step's activations come off it, and the rest is the KV budget ``kv_budget`` splits into
pools. The activation reserve is an upper estimate from the scheduler's limits, not a profile.
``worker_pool_blocks`` sizes a worker's device and host pools from its config (any device).
"""

from __future__ import annotations

import logging

import torch

from configs.schema import ClusterConfig
from engine.model.arch.model_arch import ModelArch
from engine.model.kv_budget import blocks_per_pool
from engine.model.kv_layout import KVLayout

log = logging.getLogger(__name__)

#: live activation tensors of one layer, in units of a token's widest row, with headroom
_ACTIVATION_ROWS = 8


def activation_reserve_bytes(arch: ModelArch, max_num_batched_tokens: int, max_num_seqs: int, elem_bytes: int) -> int:
    """Bytes one step's activations may take: a few rows of the widest projection per batched
    token, plus fp32 logits of every sampled row (twice: logits and probabilities)."""
    widest = max(arch.hidden_size, arch.intermediate_size, arch.num_heads * arch.head_dim)
    rows = _ACTIVATION_ROWS * max_num_batched_tokens * widest * max(elem_bytes, 4)
    logits = 2 * max_num_seqs * arch.vocab_size * 4
    return rows + logits


def gpu_kv_budget_bytes(device: torch.device, utilization: float, reserve_bytes: int) -> int:
    """The KV budget on ``device``: ``utilization`` of its memory, less what is in use now and
    ``reserve_bytes``. Raises ValueError naming the field when nothing is left."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(utilization * total) - (total - free) - reserve_bytes
    log.info(
        "GPU KV budget: %.1f GiB of %.1f GiB (utilization %.2f, %.1f GiB in use, %.1f GiB activation reserve)",
        budget / 2**30,
        total / 2**30,
        utilization,
        (total - free) / 2**30,
        reserve_bytes / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            f"kv_cache.gpu_memory_utilization: {utilization} of {total / 2**30:.1f} GiB leaves no KV memory"
            f" ({(total - free) / 2**30:.1f} GiB in use, {reserve_bytes / 2**30:.1f} GiB reserved for activations)"
        )
    return budget


def worker_pool_blocks(
    arch: ModelArch, layout: KVLayout, config: ClusterConfig, device: torch.device, elem_bytes: int
) -> tuple[tuple[int, ...], list[int] | None]:
    """A worker's blocks per device pool (``kv_budget.blocks_per_pool`` over the config's budget:
    with ``kv_cache.gpu_memory_utilization``, what ``device`` has free once the weights are on it,
    less one step's activations) and per host pool (``KVLayout.host_blocks`` for
    ``kv_cache.offload.size_mib``; None without a host tier, which needs prefix caching).
    ``elem_bytes``: bytes of one activation element in the model's dtype."""
    cache = config.kv_cache
    gpu_budget = None
    if cache.gpu_memory_utilization is not None:
        scheduler = config.scheduler
        reserve = activation_reserve_bytes(arch, scheduler.max_num_batched_tokens, scheduler.max_num_seqs, elem_bytes)
        gpu_budget = gpu_kv_budget_bytes(device, cache.gpu_memory_utilization, reserve)
    num_blocks = blocks_per_pool(layout, cache, config.scheduler.max_num_seqs, gpu_budget)
    host_blocks = None
    if cache.offload.enabled and cache.prefix_caching:
        host_blocks = layout.host_blocks(num_blocks, int(cache.offload.size_mib * 2**20))
    return num_blocks, host_blocks
