"""Checks of slot tensors, of two workers' layouts and of block pairs, shared by every backend.

A worker's slot tensors belong to block pools (``slot_pool``); a pair names a block of one pool
(``(pool, remote, local)``, or ``(remote, local)`` for pool 0) and moves that block's row of
every slot tensor of its pool, nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from engine.transfer.records import AgentInfo, BlockPairs


class TransferError(RuntimeError):
    """A peer or a registration cannot be used (incompatible layout, unreachable, closed)."""


def check_slot_tensors(
    tensors: Sequence[torch.Tensor], slot_pool: Sequence[int] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate the slot tensors (and their pools: 0..P-1, each used, one row count per pool);
    return ``(rows per slot, page_bytes per slot)``."""
    if not tensors:
        raise ValueError("register: expected at least one slot tensor")
    pools = list(slot_pool) if slot_pool is not None else [0] * len(tensors)
    if len(pools) != len(tensors) or (pools and sorted(set(pools)) != list(range(max(pools) + 1))):
        raise ValueError(f"slot_pool: {pools} must name pools 0..P-1 (each used), one per slot tensor")
    device = tensors[0].device
    pages, rows = [], []
    pool_rows: dict[int, int] = {}
    for s, t in enumerate(tensors):
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(
                f"slot tensor {s}: expected a contiguous [num_blocks, page] tensor, got shape {tuple(t.shape)}"
            )
        known = pool_rows.setdefault(pools[s], t.shape[0])
        if t.shape[0] != known:
            raise ValueError(
                f"slot tensor {s}: {t.shape[0]} rows, pool {pools[s]} has {known}; the slots of a pool share block ids"
            )
        if t.device != device:
            raise ValueError(f"slot tensor {s}: on {t.device}, slot 0 is on {device}")
        pages.append(t.shape[1] * t.element_size())
        rows.append(t.shape[0])
    return tuple(rows), tuple(pages)


def check_compatible(local: AgentInfo, remote: AgentInfo) -> None:
    """Raise ``TransferError`` unless rows of ``remote``'s slots can be copied into ours."""
    if remote.backend != local.backend:
        raise TransferError(f"peer {remote.name!r} uses backend {remote.backend!r}, this worker {local.backend!r}")
    if (
        remote.page_bytes != local.page_bytes
        or remote.num_pools != local.num_pools
        or any(remote.pool_of(s) != local.pool_of(s) for s in range(local.num_slots))
    ):
        raise TransferError(
            f"peer {remote.name!r} has slot page sizes {list(remote.page_bytes)} in pools "
            f"{[remote.pool_of(s) for s in range(remote.num_slots)]}, this worker {list(local.page_bytes)} in "
            f"{[local.pool_of(s) for s in range(local.num_slots)]}: both workers must allocate the same KV layout"
        )


def as_pairs(pairs: BlockPairs, num_remote: int, num_local: int) -> tuple[np.ndarray, np.ndarray]:
    """``(remote_ids, local_ids)`` as int64 arrays; ValueError on out-of-range or duplicate targets."""
    arr = np.asarray(pairs, dtype=np.int64)
    if arr.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"pairs: expected (remote_block_id, local_block_id) pairs, got shape {arr.shape}")
    remote, local = arr[:, 0], arr[:, 1]
    if remote.min() < 0 or remote.max() >= num_remote:
        raise ValueError(f"pairs: remote block ids must be in [0, {num_remote}), got {remote.min()}..{remote.max()}")
    if local.min() < 0 or local.max() >= num_local:
        raise ValueError(f"pairs: local block ids must be in [0, {num_local}), got {local.min()}..{local.max()}")
    if np.unique(local).size != local.size:
        raise ValueError("pairs: a local block id appears twice (two sources for one destination row)")
    return np.ascontiguousarray(remote), np.ascontiguousarray(local)


def as_pool_pairs(
    pairs: BlockPairs, remote_blocks: Sequence[int], local_blocks: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pool, remote_ids, local_ids)`` int64 arrays from pairs (pool 0) or triples; ValueError
    on an unknown pool, ids out of their pool's range or a local block of a pool named twice."""
    arr = np.asarray(pairs, dtype=np.int64)
    if arr.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3):
        raise ValueError(f"pairs: expected (remote, local) pairs or (pool, remote, local) triples, got {arr.shape}")
    if arr.shape[1] == 2:
        arr = np.concatenate([np.zeros((arr.shape[0], 1), np.int64), arr], axis=1)
    pool = arr[:, 0]
    if pool.min() < 0 or pool.max() >= len(local_blocks) or len(remote_blocks) != len(local_blocks):
        raise ValueError(f"pairs: pools must be in [0, {len(local_blocks)}), got {pool.min()}..{pool.max()}")
    remote, local = np.empty(len(arr), np.int64), np.empty(len(arr), np.int64)
    for p in np.unique(pool).tolist():
        rows = pool == p
        remote[rows], local[rows] = as_pairs(arr[rows, 1:], remote_blocks[p], local_blocks[p])
    return np.ascontiguousarray(pool), remote, local
