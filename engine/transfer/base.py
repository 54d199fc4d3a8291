"""The KV transfer interface shared by every backend, and the plain data that crosses processes.

Layout (decided by the model runner): a worker owns S *slot tensors*, each a contiguous
``[num_blocks, page_bytes[s]]`` tensor. Block id ``b`` of any KV-cache group addresses row ``b``
of every slot tensor, so moving block ``r`` of a peer into local block ``l`` means copying row
``r`` of each of the peer's S slot tensors into row ``l`` of the matching local slot tensor.
A request transfer is a list of ``(remote_block_id, local_block_id)`` pairs; which blocks travel
is the coordinator's decision, the transport moves exactly those rows and nothing else.

Lifecycle of one worker::

    xfer = make_transfer(cfg.transfer.backend, name="decode-0", role="reader")
    slots = xfer.allocate_slots(num_blocks, page_bytes)     # or any tensors (nixl only)
    info = xfer.register(slots)                               # once, before anything is exported
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

import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TransferStatus = Literal["pending", "done", "failed"]
PENDING: TransferStatus = "pending"
DONE: TransferStatus = "done"
FAILED: TransferStatus = "failed"

Role = Literal["owner", "reader", "both"]
"""What a worker does with its transfer object: ``owner`` (prefill: others read its blocks),
``reader`` (decode: reads peers' blocks), ``both``. Backends may tune themselves by role (NIXL
runs its progress thread only where someone else's reads depend on it)."""

BlockPairs = Sequence[tuple[int, int]] | np.ndarray
"""``(remote_block_id, local_block_id)`` pairs, or an ``[n, 2]`` integer array of them."""


class TransferError(RuntimeError):
    """A peer or a registration cannot be used (incompatible layout, unreachable, closed)."""


@dataclass(frozen=True)
class AgentInfo:
    """Everything a peer needs to read this worker's slot tensors. Plain data only (str, int,
    bytes, tuples), so it pickles and travels as a Ray argument or return value.

    ``page_bytes[s]`` is the row size of slot tensor ``s``; ``num_blocks`` its row count.
    NIXL fills ``metadata`` (the agent blob), ``base_addrs``, ``mem_type`` and ``device_id``;
    the local backend fills ``shm_paths`` and ``notify_addr``.
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

    @property
    def num_slots(self) -> int:
        return len(self.page_bytes)

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across all slot tensors (what one pair moves)."""
        return sum(self.page_bytes)


@dataclass(slots=True)
class ReadRecord:
    """Bookkeeping of one read; ``handle`` is backend-private and never leaves the process."""

    peer: str
    num_blocks: int
    nbytes: int
    started: float
    deadline: float
    status: TransferStatus = PENDING
    error: str | None = None
    setup_s: float = 0.0
    handle: Any = field(default=None, repr=False)


def check_slot_tensors(tensors: Sequence[torch.Tensor]) -> tuple[int, tuple[int, ...]]:
    """Validate the slot tensors; return ``(num_blocks, page_bytes per slot)``."""
    if not tensors:
        raise ValueError("register: expected at least one slot tensor")
    num_blocks = tensors[0].shape[0] if tensors[0].dim() == 2 else -1
    device = tensors[0].device
    pages = []
    for s, t in enumerate(tensors):
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(
                f"slot tensor {s}: expected a contiguous [num_blocks, page] tensor, got shape {tuple(t.shape)}"
            )
        if t.shape[0] != num_blocks:
            raise ValueError(f"slot tensor {s}: {t.shape[0]} rows, slot 0 has {num_blocks}; all slots share block ids")
        if t.device != device:
            raise ValueError(f"slot tensor {s}: on {t.device}, slot 0 is on {device}")
        pages.append(t.shape[1] * t.element_size())
    return num_blocks, tuple(pages)


def check_compatible(local: AgentInfo, remote: AgentInfo) -> None:
    """Raise ``TransferError`` unless rows of ``remote``'s slots can be copied into ours."""
    if remote.backend != local.backend:
        raise TransferError(f"peer {remote.name!r} uses backend {remote.backend!r}, this worker {local.backend!r}")
    if remote.page_bytes != local.page_bytes:
        raise TransferError(
            f"peer {remote.name!r} has slot page sizes {list(remote.page_bytes)}, this worker "
            f"{list(local.page_bytes)}: both workers must allocate the same KV layout"
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
    def allocate_slots(self, num_blocks: int, page_bytes: Sequence[int], device: str = "cpu") -> list[torch.Tensor]:
        """Zeroed ``[num_blocks, page_bytes[s]]`` uint8 tensors this backend can serve to peers.

        The runner should allocate its KV slots here: the local backend needs them in shared
        memory; NIXL registers any tensors, but on CPU these sit on huge pages (faster reads).
        """

    def register(self, tensors: Sequence[torch.Tensor]) -> AgentInfo:
        """Register this worker's slot tensors (once, before exporting) and return its AgentInfo."""
        self._check_open()
        if self._info is not None:
            raise TransferError(f"{self.name}: slot tensors are already registered")
        num_blocks, page_bytes = check_slot_tensors(tensors)
        self._info = self._register(list(tensors), num_blocks, page_bytes)
        logger.info(
            "%s: registered %d slot tensors x %d blocks (%.1f MiB) [%s]",
            self.name,
            len(page_bytes),
            num_blocks,
            num_blocks * sum(page_bytes) / 2**20,
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
        remote_ids, local_ids = as_pairs(pairs, info.num_blocks, local.num_blocks)
        rec.num_blocks = int(local_ids.size)
        rec.nbytes = rec.num_blocks * local.block_bytes
        self._reads[tid] = rec
        try:
            self._start(rec, info, remote_ids, local_ids, bytes(notify), t0)
        except Exception as e:  # a transport error must not take the engine loop down
            self._fail(tid, rec, f"start: {type(e).__name__}: {e}")
        if rec.status == FAILED:
            logger.warning("%s: read %d from %s failed: %s", self.name, tid, name, rec.error)
        return tid

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
                except Exception as e:
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

    def __enter__(self) -> KVTransfer:
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
        except Exception as e:  # cancellation is best effort; the record is failed either way
            logger.warning("%s: cancelling read %d failed: %s", self.name, tid, e)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name}: transfer object is closed")

    # -- backend hooks -----------------------------------------------------------------------
    @abstractmethod
    def _register(self, tensors: list[torch.Tensor], num_blocks: int, page_bytes: tuple[int, ...]) -> AgentInfo: ...

    @abstractmethod
    def _add_peer(self, info: AgentInfo) -> None: ...

    @abstractmethod
    def _remove_peer(self, name: str) -> None: ...

    @abstractmethod
    def _start(
        self,
        rec: ReadRecord,
        peer: AgentInfo,
        remote_ids: np.ndarray,
        local_ids: np.ndarray,
        notify: bytes,
        t0: float,
    ) -> None:
        """Begin the read; set ``rec.status`` (DONE if already complete), ``rec.handle``, ``rec.setup_s``."""

    @abstractmethod
    def _progress(self, rec: ReadRecord) -> None:
        """Advance a pending read; set ``rec.status`` to DONE or FAILED (with ``rec.error``)."""

    @abstractmethod
    def _cancel(self, rec: ReadRecord) -> None:
        """Free the backend handle of a read (cancelling it if still in flight). Idempotent."""

    @abstractmethod
    def _close(self) -> None: ...
