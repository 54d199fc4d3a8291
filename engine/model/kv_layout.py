"""How a model's layers map onto KV-cache groups and shared slot tensors (no torch here).

Layers are bucketed by spec (full attention, sliding window W, Mamba); every bucket is cut into
groups of ``G`` layers, ``G`` being the smallest bucket's size. The worker allocates ``G`` slot
tensors of ``[num_blocks, page_bytes]``; slot ``j`` holds the page of the ``j``-th layer of every
group, so a block id addresses one page per slot and groups draw disjoint ids from one pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.spec import FullAttentionSpec, KVCacheGroup, KVCacheSpec, MambaSpec, SlidingWindowSpec
from engine.model.arch import CACHELESS_KINDS, RECURRENT_KINDS, ModelArch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    """Groups for the coordinator, and for each layer: its group and its slot tensor."""

    groups: list[KVCacheGroup]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int
    page_bytes: int
    block_size: int

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        return max(2, budget_bytes // (self.num_slots * self.page_bytes))


def attention_page_bytes(arch: ModelArch, block_size: int, dtype: str) -> int:
    return 2 * block_size * arch.num_kv_heads * arch.head_dim * DTYPE_BYTES[dtype]


def mamba_page_bytes(arch: ModelArch) -> int:
    """One recurrent layer's state per block (e.g. Mamba's conv window and SSM state), in fp32."""
    return arch.recurrent_state_floats * 4


def _page_bytes(arch: ModelArch, block_size: int, dtype: str) -> int:
    """The largest page any layer needs, rounded up to whole attention rows (one token's K or V
    for all KV heads) so attention can address its cache as rows."""
    has_attention = any(layer.kind in ("full_attention", "sliding_attention") for layer in arch.layers)
    page = max(
        attention_page_bytes(arch, block_size, dtype) if has_attention else 0,
        mamba_page_bytes(arch),
    )
    if has_attention:
        row = arch.num_kv_heads * arch.head_dim * DTYPE_BYTES[dtype]
        page = -(-page // row) * row
    return page


def build_kv_layout(arch: ModelArch, block_size: int, dtype: str) -> KVLayout:
    """Group the model's layers and size one page (the largest any layer needs)."""
    buckets: dict[tuple, list[int]] = {}
    for index, layer in enumerate(arch.layers):
        if layer.kind in CACHELESS_KINDS:
            continue
        key: tuple = (layer.kind, layer.window)
        buckets.setdefault(key, []).append(index)
    size = min(len(layers) for layers in buckets.values())
    groups: list[KVCacheGroup] = []
    layer_group = [-1] * arch.num_layers  # -1: a layer without cache
    layer_slot = [-1] * arch.num_layers
    for (kind, window), layers in buckets.items():
        spec: KVCacheSpec
        if kind == "sliding_attention":
            spec = SlidingWindowSpec(block_size, int(window))
        elif kind == "full_attention":
            spec = FullAttentionSpec(block_size)
        elif kind in RECURRENT_KINDS:
            spec = MambaSpec(block_size)
        else:
            raise ValueError(f"layer kind {kind!r} has no KV-cache spec")
        for start in range(0, len(layers), size):
            members = layers[start : start + size]
            for slot, layer in enumerate(members):
                layer_group[layer] = len(groups)
                layer_slot[layer] = slot
            groups.append(KVCacheGroup(spec, tuple(f"layers.{i}" for i in members)))
    return KVLayout(
        groups=groups,
        layer_group=tuple(layer_group),
        layer_slot=tuple(layer_slot),
        num_slots=size,
        page_bytes=_page_bytes(arch, block_size, dtype),
        block_size=block_size,
    )
