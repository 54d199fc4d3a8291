"""The capacity side of ``benchmarks/hybrid_capacity.py``: cacheable prefix tokens per layout.

Owns the capacity of one model at one budget (``capacity``) under each layout: the ideal (all
attention KV, no padding), the old single padded page, vLLM's unified page (``vllm_group_size``,
vLLM 0.33's grouping rule, and ``one_pool_tokens``) and kvfleet's pooled layout.
"""

from __future__ import annotations

from typing import Any

from benchmarks.support.hybrid_models import BLOCK, DTYPE, GIB, count
from engine.model.arch.model_arch import CACHELESS_KINDS, RECURRENT_KINDS, ModelArch
from engine.model.kv_budget import STATES_PER_RUNNING_REQUEST, split_budget
from engine.model.kv_layout import (
    attention_page_bytes,
    build_kv_layout,
    mamba_page_bytes,
    padded_page_bytes,
)


def vllm_group_size(bucket_sizes: list[int]) -> int:
    """vLLM 0.33's ``_get_kv_cache_groups_uniform_page_size`` rule."""
    smallest, largest = min(bucket_sizes), max(bucket_sizes)
    return largest if largest < smallest * 1.5 else smallest


def one_pool_tokens(
    budget: int, page: int, group_size: int, attn_groups: int, rec_groups: int, block_tokens: int, max_num_seqs: int
) -> int:
    """Attention tokens of a one-pool layout once the running requests' states are reserved."""
    blocks = budget // (page * group_size)
    reserved = max_num_seqs * rec_groups * STATES_PER_RUNNING_REQUEST + 1
    return max(0, blocks - reserved) // attn_groups * block_tokens


def capacity(arch: ModelArch, vllm: dict[str, Any], budget: int, max_num_seqs: int) -> dict[str, Any]:
    n_attn = count(arch, ("full_attention", "sliding_attention"))
    n_rec = count(arch, RECURRENT_KINDS)
    token_bytes = attention_page_bytes(arch, 1, DTYPE) * n_attn
    state = mamba_page_bytes(arch)
    running = max_num_seqs * n_rec * STATES_PER_RUNNING_REQUEST * state
    ideal = (budget - running) / token_bytes

    layout = build_kv_layout(arch, BLOCK, DTYPE)
    split = split_budget(layout, budget, max_num_seqs)
    ours = layout.capacity(split.num_blocks)["tokens"]

    g_old = min(n_attn, n_rec)  # the old rule: cut every bucket by the smallest bucket's size
    padded = one_pool_tokens(
        budget,
        padded_page_bytes(arch, BLOCK, DTYPE),
        g_old,
        -(-n_attn // g_old),
        -(-n_rec // g_old),
        BLOCK,
        max_num_seqs,
    )
    g_v = vllm_group_size([n_attn, n_rec])
    block_v = vllm["kvfleet_state"]["block_size"]
    page_v = max(vllm["kvfleet_state"]["page_bytes"], state)
    unified = one_pool_tokens(budget, page_v, g_v, -(-n_attn // g_v), -(-n_rec // g_v), block_v, max_num_seqs)
    return {
        "layers": {"attention": n_attn, "recurrent": n_rec, "cacheless": count(arch, CACHELESS_KINDS)},
        "state_bytes": state,
        "attention_bytes_per_token": token_bytes,
        "ideal_tokens": int(ideal),
        "tokens": {"kvfleet": ours, "padded": padded, "vllm_unified": unified},
        "tokens_per_gib": {
            "ideal": ideal / (budget / GIB),
            "kvfleet": ours / (budget / GIB),
            "padded": padded / (budget / GIB),
            "vllm_unified": unified / (budget / GIB),
        },
        "over_ideal": {"kvfleet": ours / ideal, "padded": padded / ideal, "vllm_unified": unified / ideal},
        "kvfleet_pools": [
            {"kind": p.kind, "page_bytes": p.page_bytes, "slots": p.num_slots, "blocks": n}
            for p, n in zip(layout.pools, split.num_blocks, strict=True)
        ],
        "kvfleet_cached_states": split.cached_states,
        "vllm_block_size": {"kvfleet_state": block_v, "vllm_state": vllm["vllm_state"]["block_size"]},
        "vllm_group_size": g_v,
        "padded_page_bytes": padded_page_bytes(arch, BLOCK, DTYPE),
    }
