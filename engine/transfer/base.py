"""The KV transfer interface shared by every backend (``KVTransfer``); the plain data that crosses
processes (``AgentInfo``) and a read's bookkeeping (``ReadRecord``) are in ``records.py``, re-exported here.

Layout (decided by the model runner): a worker owns S *slot tensors*, each a contiguous
``[num_blocks_p, page_bytes[s]]`` tensor of one block *pool* ``p = slot_pool[s]`` (one pool per
page size: attention pages, recurrent states). Block id ``b`` of a pool addresses row ``b`` of
every slot tensor of that pool and nothing else, so moving block ``r`` of a peer's pool ``p``
into local block ``l`` means copying row ``r`` of each of the peer's slot tensors of pool ``p``
into row ``l`` of the matching local slot tensor. A request transfer is a list of
``(pool, remote_block_id, local_block_id)`` triples (or ``(remote, local)`` pairs: pool 0);
which blocks travel is the coordinator's decision, the transport moves exactly those rows, each
at its own pool's page size, and nothing else.

Lifecycle of one worker::

    xfer = make_transfer(cfg.transfer.backend, name="decode-0", role="reader")
    slots = xfer.allocate_slots(rows, page_bytes)            # rows per slot (an int: all alike)
    info = xfer.register(slots, slot_pool)                    # once, before anything is exported
    ...                                                       # info (plain data) travels via Ray
    tid = xfer.start_read(peer_info, pairs, notify=b"req-7")  # adds the peer on first use
    xfer.poll([tid]) -> {tid: "pending" | "done" | "failed"}   # every engine step
    xfer.release(tid)                                         # after done/failed
    owner side: xfer.owner_notifications() -> [b"req-7", ...] # then free the request's blocks

Contract: ``start_read`` and ``poll`` never raise for runtime failures (timeout, peer gone,
transport error); those surface as ``"failed"`` with a reason in ``error(tid)``. Every pending
read has a deadline of ``read_timeout_s`` from its start; ``poll`` turns an expired read into
``"failed"`` and cancels it. Malformed input (out-of-range or duplicate local block ids, slot
tensors of the wrong shape) raises ``ValueError``: that is a caller bug, not a transfer failure.
Objects are not thread-safe: call them from the worker's engine loop only.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Self

import numpy as np

from engine.transfer.pairs import (
    TransferError,
    as_pool_pairs,
    check_compatible,
    check_slot_tensors,
)
from engine.transfer.records import (
    FAILED,
    PENDING,
    AgentInfo,
    BlockPairs,
    ReadRecord,
    TransferStatus,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class KVTransfer(ABC):
    """Moves block rows between the slot tensors of two workers; see the module docstring.

    Subclasses implement ``allocate_slots``, ``_register``, ``_add_peer``, ``_remove_peer``,
    ``_start``, ``_progress``, ``_cancel``, ``owner_notifications`` and ``_close``; this class
    owns ids, deadlines, status bookkeeping and argument checks.
    """

    backend: str = ""

    def __init__(self, name: str, read_timeout_s: float):
        if read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s: must be > 0 (got {read_timeout_s})")
        self.name = name
        self.read_timeout_s = read_timeout_s
        self._info: AgentInfo | None = None
        self._peers: dict[str, AgentInfo] = {}
        self._reads: dict[int, ReadRecord] = {}
        self._ids = itertools.count(1)
        self._closed = False

    # -- memory ------------------------------------------------------------------------------
    @abstractmethod
    def allocate_slots(
        self, num_blocks: int | Sequence[int], page_bytes: Sequence[int], device: str = "cpu"
    ) -> list[torch.Tensor]:
        """Zeroed ``[num_blocks[s], page_bytes[s]]`` uint8 tensors this backend can serve to peers
        (an int ``num_blocks``: every slot has that many rows).

        The runner should allocate its KV slots here: the local backend needs them in shared
        memory; NIXL registers any tensors, but on CPU these sit on huge pages (faster reads).
        """

    def register(self, tensors: Sequence[torch.Tensor], slot_pool: Sequence[int] | None = None) -> AgentInfo:
        """Register this worker's slot tensors (once, before exporting) and return its AgentInfo.
        ``slot_pool[s]`` names the block pool of slot tensor ``s`` (None: one pool)."""
        self._check_open()
        if self._info is not None:
            raise TransferError(f"{self.name}: slot tensors are already registered")
        rows, page_bytes = check_slot_tensors(tensors, slot_pool)
        info = self._register(list(tensors), rows, page_bytes)
        if slot_pool is not None and max(slot_pool) > 0:
            info = dataclasses.replace(
                info, num_blocks=rows[list(slot_pool).index(0)], slot_pool=tuple(slot_pool), slot_blocks=rows
            )
        self._info = info
        logger.info(
            "%s: registered %d slot tensors in %d pools (%.1f MiB) [%s]",
            self.name,
            len(page_bytes),
            info.num_pools,
            sum(r * p for r, p in zip(rows, page_bytes, strict=True)) / 2**20,
            self.backend,
        )
        return self._info

    @property
    def agent_info(self) -> AgentInfo:
        if self._info is None:
            raise TransferError(f"{self.name}: register() the slot tensors first")
        return self._info

    # -- peers -------------------------------------------------------------------------------
    def add_peer(self, info: AgentInfo) -> str:
        """Make ``info``'s slots readable; idempotent for the same info, replaces a changed one.

        Descriptor lists (or mappings) are prepared here, once per peer. Raises TransferError if
        the peer is incompatible or unreachable.
        """
        self._check_open()
        known = self._peers.get(info.name)
        if known == info:
            return info.name
        if known is not None:
            self.remove_peer(info.name)
        check_compatible(self.agent_info, info)
        self._add_peer(info)
        self._peers[info.name] = info
        logger.debug("%s: added peer %s (%d blocks)", self.name, info.name, info.num_blocks)
        return info.name

    def remove_peer(self, name: str) -> None:
        """Forget a peer: its pending reads fail, its descriptors/mappings are released."""
        if self._peers.pop(name, None) is None:
            return
        for tid, rec in self._reads.items():
            if rec.peer == name and rec.status == PENDING:
                self._fail(tid, rec, f"peer {name} removed")
        self._remove_peer(name)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    # -- reads -------------------------------------------------------------------------------
    def start_read(self, peer: str | AgentInfo, pairs: BlockPairs, notify: bytes = b"") -> int:
        """Start copying the peer's rows into ours; return a transfer id for ``poll``.

        ``peer`` is a name given by ``add_peer`` or an AgentInfo (added on first use). The peer
        receives ``notify`` through ``owner_notifications()`` once the read is complete; with no
        pairs only the notification is sent (a full local hit still lets the owner free).
        """
        self._check_open()
        tid = next(self._ids)
        local = self.agent_info
        name = peer.name if isinstance(peer, AgentInfo) else peer
        now = time.monotonic()
        rec = ReadRecord(name, 0, 0, started=now, deadline=now + self.read_timeout_s)
        info = self._peers.get(name)
        if isinstance(peer, AgentInfo):
            try:
                info = self._peers[self.add_peer(peer)]
            except TransferError as e:
                return self._failed_at_start(tid, rec, str(e))
        if info is None:
            return self._failed_at_start(tid, rec, f"unknown peer {name!r} (never added, or removed)")
        t0 = time.perf_counter()  # setup time: from here (peer prepared) to the transfer's post
        pool_ids, remote_ids, local_ids = as_pool_pairs(pairs, info.pool_blocks, local.pool_blocks)
        rec.num_blocks = int(local_ids.size)
        rec.nbytes = int(np.asarray(local.pool_block_bytes, np.int64)[pool_ids].sum())
        self._reads[tid] = rec
        try:
            self._start(rec, info, pool_ids, remote_ids, local_ids, bytes(notify), t0)
        except Exception as e:  # noqa: BLE001 - a transport error must not take the engine loop down
            self._fail(tid, rec, f"start: {type(e).__name__}: {e}")
        if rec.status == FAILED:
            logger.warning("%s: read %d from %s failed: %s", self.name, tid, name, rec.error)
        return tid

    def warm_up(self, peer: AgentInfo) -> int:
        """Make ``peer`` ready so its first real read pays no connection setup; returns a
        transfer id to poll and release. Here: add the peer and send a notification-only read
        (backends whose connections cost more per region override this)."""
        return self.start_read(peer, [], notify=b"kvfleet-warm-up")

    def _failed_at_start(self, tid: int, rec: ReadRecord, reason: str) -> int:
        rec.status, rec.error = FAILED, reason
        self._reads[tid] = rec
        logger.warning("%s: read %d from %s failed: %s", self.name, tid, rec.peer, reason)
        return tid

    def poll(self, ids: Iterable[int]) -> dict[int, TransferStatus]:
        """Status of each read; a pending read past its deadline is cancelled and reported failed."""
        now = time.monotonic()
        out: dict[int, TransferStatus] = {}
        for tid in ids:
            rec = self._reads[tid]
            if rec.status == PENDING:
                try:
                    self._progress(rec)
                except Exception as e:  # noqa: BLE001 - a transport error fails this read, not the engine loop
                    self._fail(tid, rec, f"progress: {type(e).__name__}: {e}")
                if rec.status == PENDING and now > rec.deadline:
                    self._fail(tid, rec, f"timed out after {self.read_timeout_s:g} s")
                if rec.status == FAILED:
                    logger.warning("%s: read %d from %s failed: %s", self.name, tid, rec.peer, rec.error)
            out[tid] = rec.status
        return out

    def wait(self, tid: int, timeout_s: float | None = None) -> TransferStatus:
        """Poll one read until it is not pending (bounded by its deadline, or ``timeout_s``)."""
        end = time.monotonic() + (self.read_timeout_s if timeout_s is None else timeout_s)
        spin_until = time.monotonic() + 0.002
        while True:
            status = self.poll([tid])[tid]
            if status != PENDING or time.monotonic() > end:
                return status
            if time.monotonic() > spin_until:
                time.sleep(0.0005)

    def error(self, tid: int) -> str | None:
        """Why a read failed (None unless failed)."""
        return self._reads[tid].error

    def read_record(self, tid: int) -> ReadRecord:
        """Telemetry of one read: blocks, bytes, setup time, status, error."""
        return self._reads[tid]

    def release(self, tid: int) -> None:
        """Drop a read's bookkeeping; a still-pending read is cancelled first (it never completes)."""
        rec = self._reads.pop(tid, None)
        if rec is None:
            return
        if rec.status == PENDING:
            rec.status = FAILED
            rec.error = "released while pending"
        self._cancel(rec)

    @property
    def num_pending(self) -> int:
        return sum(rec.status == PENDING for rec in self._reads.values())

    @abstractmethod
    def owner_notifications(self) -> list[bytes]:
        """Notifications received since the last call: the ``notify`` of every completed read of
        this worker's blocks. Call it every engine step on workers that own blocks."""

    # -- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel pending reads, release peers and registrations. Idempotent."""
        if self._closed:
            return
        for tid in list(self._reads):
            self.release(tid)
        for name in list(self._peers):
            self.remove_peer(name)
        self._close()
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for subclasses --------------------------------------------------------------
    def _fail(self, tid: int, rec: ReadRecord, reason: str) -> None:
        if rec.status != PENDING:
            return
        rec.status = FAILED
        rec.error = reason
        try:
            self._cancel(rec)
        except Exception as e:  # noqa: BLE001 - cancellation is best effort; the record is failed either way
            logger.warning("%s: cancelling read %d failed: %s", self.name, tid, e)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name}: transfer object is closed")

    # -- backend hooks -----------------------------------------------------------------------
    @abstractmethod
    def _register(self, tensors: list[torch.Tensor], rows: tuple[int, ...], page_bytes: tuple[int, ...]) -> AgentInfo:
        """The AgentInfo of these slots (``rows``: per slot; ``register`` adds the pools)."""

    @abstractmethod
    def _add_peer(self, info: AgentInfo) -> None: ...

    @abstractmethod
    def _remove_peer(self, name: str) -> None: ...

    @abstractmethod
    def _start(
        self,
        rec: ReadRecord,
        peer: AgentInfo,
        pool_ids: np.ndarray,
        remote_ids: np.ndarray,
        local_ids: np.ndarray,
        notify: bytes,
        t0: float,
    ) -> None:
        """Begin the read (row ``remote_ids[i]`` of every peer slot of pool ``pool_ids[i]`` into
        row ``local_ids[i]`` of the local slot of the same index); set ``rec.status`` (DONE if
        already complete), ``rec.handle``, ``rec.setup_s``."""

    @abstractmethod
    def _progress(self, rec: ReadRecord) -> None:
        """Advance a pending read; set ``rec.status`` to DONE or FAILED (with ``rec.error``)."""

    @abstractmethod
    def _cancel(self, rec: ReadRecord) -> None:
        """Free the backend handle of a read (cancelling it if still in flight). Idempotent."""

    @abstractmethod
    def _close(self) -> None: ...
