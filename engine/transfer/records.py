"""The plain data of the KV transfer interface (see ``base.py`` for the contract): a read's
status, a worker's role, the block pairs a read moves, ``AgentInfo`` (what a peer needs to read
this worker's slot tensors; it crosses processes) and ``ReadRecord`` (one read's bookkeeping,
never leaves its process). Re-exported by ``engine.transfer.base`` and ``engine.transfer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

TransferStatus = Literal["pending", "done", "failed"]
PENDING: TransferStatus = "pending"
DONE: TransferStatus = "done"
FAILED: TransferStatus = "failed"

Role = Literal["owner", "reader", "both"]
"""What a worker does with its transfer object: ``owner`` (prefill: others read its blocks),
``reader`` (decode: reads peers' blocks), ``both``. Backends may tune themselves by role (NIXL
runs its progress thread only where someone else's reads depend on it)."""

BlockPairs = Sequence[tuple[int, int]] | Sequence[tuple[int, int, int]] | np.ndarray
"""``(remote_block_id, local_block_id)`` pairs (pool 0), ``(pool, remote_block_id,
local_block_id)`` triples, or an ``[n, 2]`` / ``[n, 3]`` integer array of them."""


@dataclass(frozen=True)
class AgentInfo:
    """Everything a peer needs to read this worker's slot tensors. Plain data only (str, int,
    bytes, tuples), so it pickles and travels as a Ray argument or return value.

    ``page_bytes[s]`` is the row size of slot tensor ``s``, ``slot_pool[s]`` its pool (empty: every
    slot in pool 0) and ``slot_blocks[s]`` its row count (empty: ``num_blocks`` each);
    ``num_blocks`` is pool 0's row count. NIXL fills ``metadata`` (the agent blob), ``base_addrs``,
    ``mem_type`` and ``device_id``; the local backend fills ``notify_addr``, ``mem_type``,
    ``device_id`` and, for CPU slots, ``shm_paths``; for CUDA slots ``cuda_ipc``: per slot, the
    plain part of torch's CUDA IPC reduction (see ``local_cuda.share``). A worker split over
    tensor-parallel ranks (engine/rank_group.py) is published as rank 0's info with ``ranks``:
    the infos of its ranks 1 .. N - 1, in rank order (empty on one rank); a reader's rank r
    reads its own shard from ``ranks[r - 1]``.

    Invariant: frozen and compared by value (``KVTransfer.add_peer`` takes an equal info for the
    peer it already has).
    """

    backend: str
    name: str
    num_blocks: int
    page_bytes: tuple[int, ...]
    host: str
    pid: int
    metadata: bytes = b""
    base_addrs: tuple[int, ...] = ()
    mem_type: str = "DRAM"
    device_id: int = 0
    shm_paths: tuple[str, ...] = ()
    notify_addr: bytes = b""
    slot_pool: tuple[int, ...] = ()
    slot_blocks: tuple[int, ...] = ()
    cuda_ipc: tuple[tuple[int | bytes | str, ...], ...] = ()
    ranks: tuple[AgentInfo, ...] = ()

    @property
    def tensor_parallel_size(self) -> int:
        """The ranks of the worker this info publishes (1: one rank)."""
        return 1 + len(self.ranks)

    @property
    def num_slots(self) -> int:
        return len(self.page_bytes)

    def pool_of(self, slot: int) -> int:
        return self.slot_pool[slot] if self.slot_pool else 0

    def rows_of(self, slot: int) -> int:
        return self.slot_blocks[slot] if self.slot_blocks else self.num_blocks

    @property
    def num_pools(self) -> int:
        return max(self.slot_pool) + 1 if self.slot_pool else 1

    @property
    def pool_blocks(self) -> tuple[int, ...]:
        """Row count of every pool."""
        rows = [0] * self.num_pools
        for s in range(self.num_slots):
            rows[self.pool_of(s)] = self.rows_of(s)
        return tuple(rows)

    @property
    def pool_block_bytes(self) -> tuple[int, ...]:
        """Bytes one block of each pool occupies across that pool's slot tensors."""
        sizes = [0] * self.num_pools
        for s, page in enumerate(self.page_bytes):
            sizes[self.pool_of(s)] += page
        return tuple(sizes)

    @property
    def block_bytes(self) -> int:
        """Bytes one block of pool 0 occupies across its slot tensors (what one pair moves)."""
        return self.pool_block_bytes[0]


@dataclass(slots=True)
class ReadRecord:
    """Bookkeeping of one read; ``handle`` is backend-private and never leaves the process.

    Invariant: ``status`` leaves PENDING at most once, for DONE or FAILED, and a FAILED record
    says why in ``error``."""

    peer: str
    num_blocks: int
    nbytes: int
    started: float
    deadline: float
    status: TransferStatus = PENDING
    error: str | None = None
    setup_s: float = 0.0
    handle: Any = field(default=None, repr=False)
