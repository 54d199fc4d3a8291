"""The KV budget of a CUDA worker from ``kv_cache.gpu_memory_utilization`` (what the GPU has free).

Called once the weights are on the GPU: the worker may hold ``utilization`` of the card's memory
in all; whatever is in use already (the weights, other processes, the CUDA context) and a reserve
for one step's activations come off it, and the rest is the KV budget ``kv_budget`` splits into
pools. The activation reserve is an upper estimate from the scheduler's limits, not a profile.
"""

from __future__ import annotations

import logging

import torch

from engine.model.arch.model_arch import ModelArch

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
