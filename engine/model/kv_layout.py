"""How a model's layers map onto KV-cache groups, block pools and slot tensors (no torch here).

One block pool per page size, so no group pays for another group's page:

* the *attention pool* (pool 0 when the model has attention) holds pages of
  ``kv_cache.block_size`` tokens of K and V for one layer; full and sliding-window groups draw
  from it, and attention hashing and hits stay at ``block_size`` tokens;
* a *state pool* per recurrent state size (Mamba2, Gated DeltaNet: ``RECURRENT_KINDS``) holds
  pages of exactly one layer's fp32 state.

Within a pool, layers are bucketed by spec (full, sliding window W, recurrent kind) and every
bucket is cut into groups of ``G_p`` layers, ``G_p`` chosen per pool (see ``_group_size``): the
pool's largest size that divides every bucket (no group has an unused slot), unless that makes
many more groups than cutting by the smallest bucket. The worker allocates ``G_p`` slot tensors
``[num_blocks_p, page_bytes_p]`` per pool; slot ``j`` of pool ``p`` holds the page of the
``j``-th layer of every group of that pool, so a block id of pool ``p`` addresses one page per
slot of that pool and nothing in any other pool.

With a single pool (pure attention models) groups, slots and page size are what one shared
page size gave before pools existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd
from typing import Literal

from engine.kv_cache.coordinator_types import per_pool
from engine.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from engine.model.arch.model_arch import CACHELESS_KINDS, RECURRENT_KINDS, LayerArch, ModelArch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ATTENTION_KINDS = ("full_attention", "sliding_attention")
PoolKind = Literal["attention", "state"]


@dataclass(frozen=True)
class PoolLayout:
    """One block pool: what its pages hold, their size and how many slot tensors it has.

    Invariant: every group of the pool has exactly ``num_slots`` layers, unless the pool's
    buckets forced a partial group (``unused_slot_pages`` > 0 says how many pages stay empty).
    """

    kind: PoolKind
    page_bytes: int
    num_slots: int
    num_groups: int
    unused_slot_pages: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes one block of this pool occupies over all its slot tensors (one transfer pair)."""
        return self.page_bytes * self.num_slots


@dataclass(frozen=True)
class KVLayout:
    """Groups for the coordinator (each naming its pool), the pools, and for each layer its
    group, pool and slot (all -1 for a layer without cache).

    Invariants: a group's layers all have one spec and one page size, the page size of its pool;
    ``layer_slot[i] < pools[layer_pool[i]].num_slots``; no two layers of one group share a slot;
    attention and state pages never share a pool.
    """

    groups: list[KVCacheGroup]
    layer_group: tuple[int, ...]
    layer_pool: tuple[int, ...]
    layer_slot: tuple[int, ...]
    pools: tuple[PoolLayout, ...]
    block_size: int
    dtype: str = "float32"  # of the attention KV (states are fp32)

    @property
    def num_pools(self) -> int:
        return len(self.pools)

    @property
    def num_slots(self) -> int:
        """Slot tensors over all pools."""
        return sum(pool.num_slots for pool in self.pools)

    @property
    def slot_pool(self) -> tuple[int, ...]:
        """The pool of every slot tensor, pools in order (the order the runner allocates them)."""
        return tuple(p for p, pool in enumerate(self.pools) for _ in range(pool.num_slots))

    @property
    def slot_page_bytes(self) -> tuple[int, ...]:
        return tuple(self.pools[p].page_bytes for p in self.slot_pool)

    def slot_index(self, pool: int, slot: int) -> int:
        """Index of slot ``slot`` of ``pool`` in the flat list of slot tensors."""
        return sum(p.num_slots for p in self.pools[:pool]) + slot

    def groups_in(self, pool: int) -> list[int]:
        return [g for g, group in enumerate(self.groups) if group.pool == pool]

    @property
    def attention_pool(self) -> int | None:
        """Index of the attention pool (None for a model without attention layers)."""
        return next((p for p, pool in enumerate(self.pools) if pool.kind == "attention"), None)

    def pool_bytes(self, num_blocks: int | tuple[int, ...] | list[int]) -> int:
        """Memory the slot tensors take for ``num_blocks`` (an int: every pool alike)."""
        counts = per_pool("num_blocks", num_blocks, self.num_pools)
        return sum(n * pool.block_bytes for n, pool in zip(counts, self.pools, strict=True))

    def host_blocks(self, device_blocks: Sequence[int], size_bytes: int) -> list[int]:
        """Blocks of each pool's host pool (null block included) for a host tier of
        ``size_bytes``, split between pools as ``device_blocks`` split the device memory; a
        ValueError naming ``kv_cache.offload.size_mib`` when some pool would get no usable block."""
        total = self.pool_bytes(list(device_blocks))
        out = []
        for p, (n, pool) in enumerate(zip(device_blocks, self.pools, strict=True)):
            usable = size_bytes * n // total
            if usable < 1:
                raise ValueError(
                    f"kv_cache.offload.size_mib: {size_bytes / 2**20:g} MiB leaves pool {p} ({pool.kind}, "
                    f"{pool.block_bytes} B per block) no host block; raise it"
                )
            out.append(usable + 1)
        return out

    def capacity(self, num_blocks: int | tuple[int, ...] | list[int]) -> dict[str, int]:
        """What ``num_blocks`` per pool hold, with the null block of every pool left out:
        ``tokens`` whose KV every attention group can keep at once (0 without attention) and
        ``recurrent_states``, requests' full recurrent states (one page per recurrent group) the
        tightest state pool can keep at once (0 without recurrent layers)."""
        counts = per_pool("num_blocks", num_blocks, self.num_pools)
        tokens, states = 0, []
        for p, pool in enumerate(self.pools):
            usable = max(0, counts[p] - 1)
            per_request = len(self.groups_in(p))
            if pool.kind == "attention":
                tokens = usable // per_request * self.block_size
            else:
                states.append(usable // per_request)
        return {"tokens": tokens, "recurrent_states": min(states) if states else 0}

    def check_invariants(self, arch: ModelArch) -> None:
        """Raise AssertionError unless the layout invariants hold (docs/architecture.md, "The
        hybrid KV cache": groups whose pages have one size share a pool): every cache layer has
        one (pool, group, slot) and no two layers of a group share a slot; a group's layers share one spec and the
        page size and kind of its pool; attention layers sit only in attention pools and
        recurrent layers only in state pools (so a state never shares memory with an attention
        page); each pool's groups are counted and its unused slot pages are exactly its groups'
        missing layers."""
        taken: set[tuple[int, int]] = set()
        members = [0] * len(self.groups)
        for index, layer in enumerate(arch.layers):
            g, p, s = self.layer_group[index], self.layer_pool[index], self.layer_slot[index]
            if layer.kind in CACHELESS_KINDS:
                assert (g, p, s) == (-1, -1, -1), f"layer {index}: no cache, but placed at {(g, p, s)}"
                continue
            kind, page = layer_page(arch, layer, self.block_size, self.dtype)
            pool = self.pools[p]
            assert self.groups[g].pool == p and 0 <= s < pool.num_slots, f"layer {index}: {(g, p, s)}"
            assert pool.kind == kind, f"layer {index} ({layer.kind}) in a {pool.kind} pool"
            assert pool.page_bytes == page, f"layer {index}: needs {page}-byte pages, pool {p} has {pool.page_bytes}"
            assert (g, s) not in taken, f"layer {index}: group {g} slot {s} taken twice"
            assert self.groups[g].spec == _spec(layer, self.block_size), f"layer {index}: spec of group {g}"
            taken.add((g, s))
            members[g] += 1
        for p, pool in enumerate(self.pools):
            groups = self.groups_in(p)
            assert pool.num_groups == len(groups), f"pool {p}: {len(groups)} groups, says {pool.num_groups}"
            assert pool.unused_slot_pages == sum(pool.num_slots - members[g] for g in groups), f"pool {p}"
        keys = [(pool.kind, pool.page_bytes) for pool in self.pools]
        assert len(set(keys)) == len(keys), f"two pools with one page kind and size: {keys}"

    def describe(self) -> str:
        """A stable text of the layout, for comparing two workers' layouts."""
        pools = ",".join(f"{p.kind}:{p.page_bytes}x{p.num_slots}" for p in self.pools)
        groups = ",".join(f"{g.pool}:{g.spec!r}" for g in self.groups)
        return f"bs={self.block_size};pools={pools};groups={groups}"


def attention_page_bytes(arch: ModelArch, block_size: int, dtype: str) -> int:
    """One attention layer's K and V for ``block_size`` tokens."""
    return 2 * block_size * arch.num_kv_heads * arch.head_dim * DTYPE_BYTES[dtype]


def mamba_page_bytes(arch: ModelArch) -> int:
    """One recurrent layer's state (e.g. Mamba's conv window and SSM state), in fp32."""
    return arch.recurrent_state_floats * 4


def layer_page(arch: ModelArch, layer: LayerArch, block_size: int, dtype: str) -> tuple[PoolKind, int]:
    """The pool kind and page size one cache-owning layer needs."""
    if layer.kind in ATTENTION_KINDS:
        return "attention", attention_page_bytes(arch, block_size, dtype)
    if layer.kind in RECURRENT_KINDS:
        return "state", mamba_page_bytes(arch)
    raise ValueError(f"layer kind {layer.kind!r} has no KV-cache spec")


def _spec(layer: LayerArch, block_size: int) -> KVCacheSpec:
    if layer.kind == "sliding_attention":
        assert layer.window is not None  # LayerArch's invariant: sliding layers carry their window
        return SlidingWindowSpec(block_size, layer.window)
    if layer.kind == "full_attention":
        return FullAttentionSpec(block_size)
    return MambaSpec(block_size)


def _group_size(bucket_sizes: list[int]) -> int:
    """Layers per group in one pool: the largest size dividing every bucket (no unused slot
    pages), unless that gives more than twice the groups that the smallest bucket's size gives
    (then the smallest bucket's size, and the last group of a bucket may be partial)."""
    divisor = 0
    for size in bucket_sizes:
        divisor = gcd(divisor, size)
    smallest = min(bucket_sizes)
    exact_groups = sum(size // divisor for size in bucket_sizes)
    cut_groups = sum(-(-size // smallest) for size in bucket_sizes)
    return divisor if exact_groups <= 2 * cut_groups else smallest


def build_kv_layout(arch: ModelArch, block_size: int, dtype: str) -> KVLayout:
    """Pools by page size (attention first), buckets by spec, groups of each pool's group size."""
    pool_keys: list[tuple[PoolKind, int]] = []
    buckets: dict[tuple, list[int]] = {}  # (pool key, kind, window) -> layer indices
    for index, layer in enumerate(arch.layers):
        if layer.kind in CACHELESS_KINDS:
            continue
        key = layer_page(arch, layer, block_size, dtype)
        if key not in pool_keys:
            pool_keys.append(key)
        buckets.setdefault((key, layer.kind, layer.window), []).append(index)
    if not buckets:
        raise ValueError(f"{arch.architecture}: no layer keeps a KV cache or a recurrent state")
    pool_keys.sort(key=lambda k: k[0] != "attention")  # attention first; stable otherwise
    groups: list[KVCacheGroup] = []
    layer_group = [-1] * arch.num_layers
    layer_pool = [-1] * arch.num_layers
    layer_slot = [-1] * arch.num_layers
    pools: list[PoolLayout] = []
    for p, pool_key in enumerate(pool_keys):
        mine = {k: v for k, v in buckets.items() if k[0] == pool_key}
        size = _group_size([len(layers) for layers in mine.values()])
        first_group, unused = len(groups), 0
        for layers in mine.values():
            spec = _spec(arch.layers[layers[0]], block_size)
            for start in range(0, len(layers), size):
                members = layers[start : start + size]
                unused += size - len(members)
                for slot, member in enumerate(members):
                    layer_group[member], layer_pool[member], layer_slot[member] = len(groups), p, slot
                groups.append(KVCacheGroup(spec, tuple(f"layers.{i}" for i in members), pool=p))
        kind, page = pool_key
        pools.append(PoolLayout(kind, page, size, len(groups) - first_group, unused))
    return KVLayout(groups, tuple(layer_group), tuple(layer_pool), tuple(layer_slot), tuple(pools), block_size, dtype)


def padded_page_bytes(arch: ModelArch, block_size: int, dtype: str) -> int:
    """The page one shared pool would need (the largest any layer needs, rounded up to whole
    attention rows): the layout before pools, kept for comparisons (benchmarks/hybrid_capacity)."""
    pages = [layer_page(arch, layer, block_size, dtype) for layer in arch.layers if layer.kind not in CACHELESS_KINDS]
    page = max(size for _, size in pages)
    if any(kind == "attention" for kind, _ in pages):
        row = arch.num_kv_heads * arch.head_dim * DTYPE_BYTES[dtype]
        page = -(-page // row) * row
    return page
