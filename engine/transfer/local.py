"""Local transport for hosts without NIXL: two processes on one Linux host, or one process.

Memory (CPU)
    ``allocate_slots`` backs every slot tensor with a ``memfd`` (anonymous shared memory, sized
    with ``posix_fallocate`` so an out-of-memory host fails at allocation, not with SIGBUS on a
    later write) and maps it into a torch tensor. A reader maps the owner's memfds read-only
    through ``/proc/<owner pid>/fd/<fd>`` once per peer (``add_peer``) and copies rows with
    numpy slice assignment, coalescing runs of consecutive block ids into one copy.
    Why memfd rather than named ``/dev/shm`` files or ``multiprocessing.shared_memory``: nothing
    is left behind when an owner is killed (the memory goes when the last mapping does), it is
    not capped by a container's small ``/dev/shm``, and there is no resource tracker to unlink
    segments under a live reader. Requirements: Linux, same user and same PID namespace (both
    hold for Ray workers on one node). Slot tensors must come from ``allocate_slots``; register()
    refuses others.

Memory (CUDA, ``device="cuda"``; ``local_cuda.py``)
    Plain CUDA tensors, shared with readers in other processes through torch's CUDA IPC (the
    AgentInfo carries the handles, ``mem_type="VRAM"``); a reader in the owner's process uses
    the owner's tensors. Rows are copied with torch on the reader's device, in runs of
    consecutive block ids as on CPU. Both sides of a read must be on the same kind of memory.

Notifications
    The owner listens on an abstract ``AF_UNIX`` ``SOCK_SEQPACKET`` socket (a random
    abstract name; nothing on disk). ``add_peer`` connects to it, which also proves the owner is alive;
    a read sends ``notify`` as one message after the copy. A broken connection (owner gone) makes
    the read "failed". A full socket buffer (owner not draining) keeps the read pending and the
    send is retried in ``poll`` until the deadline. Datagram sockets were rejected: Linux queues
    only ``net.unix.max_dgram_qlen`` (10 here) undrained datagrams per receiver.

Reads on CPU are synchronous copies (``start_read`` returns an id that is already done); the
owner's memory stays mapped in the reader even if the owner dies, so a read never faults. Reads
on CUDA are queued on the reader's current stream: one stays pending (and its notification
unsent) until an event recorded after its copies has completed, and a read released or failed
while copying waits for that event, so its copy never lands in blocks given back. An owner in
another process must have synchronized the writes of the blocks it exports before the handle
leaves it; an owner that dies during a CUDA read is not guarded against.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.transfer.base import KVTransfer
from engine.transfer.pairs import TransferError
from engine.transfer.records import DONE, FAILED, PENDING, AgentInfo, ReadRecord, Role

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _host_id() -> str:
    """Host name plus boot id: two processes can share memory only if these match."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def copy_runs(remote_ids: np.ndarray, local_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(remote_start, local_start, length)`` runs: pairs sorted by local id, merged while both
    ids advance by one. One run = one slice copy per slot."""
    order = np.argsort(local_ids, kind="stable")
    src, dst = remote_ids[order], local_ids[order]
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist(), strict=True))


@dataclass(slots=True)
class _PendingCopy:
    """A CUDA read still copying: ``notify`` goes to the owner once ``event`` has completed."""

    event: Any  # torch.cuda.Event recorded after the read's copies
    notify: bytes


class LocalTransfer(KVTransfer):
    """Same-host KV transfer through memfd shared memory (CPU slots) or CUDA IPC (CUDA slots);
    see the module docstring."""

    backend = "local"

    def __init__(self, name: str | None = None, *, read_timeout_s: float = 10.0, role: Role = "both"):
        super().__init__(f"{name or 'kvfleet'}-{os.getpid()}-{uuid.uuid4().hex[:8]}", read_timeout_s)
        self.role = role
        self._memfds: dict[int, tuple[int, int]] = {}  # data_ptr -> (fd, nbytes) of our slots
        self._cuda_slots: set[int] = set()  # data_ptr of our CUDA slots
        self._local: list[Any] = []  # our slots: numpy views of the memfds, or the CUDA tensors
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._peer_slots: dict[str, list[Any]] = {}  # numpy views of a peer's memfds, or its CUDA tensors
        self._peer_socks: dict[str, socket.socket] = {}

    # -- memory ------------------------------------------------------------------------------
    def allocate_slots(
        self, num_blocks: int | Sequence[int], page_bytes: Sequence[int], device: str = "cpu"
    ) -> list[torch.Tensor]:
        import torch

        rows = [num_blocks] * len(page_bytes) if isinstance(num_blocks, int) else list(num_blocks)
        kind = torch.device(device).type
        if kind == "cuda":
            from engine.transfer import local_cuda

            cuda_slots = local_cuda.allocate(rows, page_bytes, device)
            self._cuda_slots.update(t.data_ptr() for t in cuda_slots)
            return cuda_slots
        if kind != "cpu":
            raise ValueError(f"local transfer backend: CPU or CUDA memory only (got device {device!r})")
        slots = []
        for s, (n, page) in enumerate(zip(rows, page_bytes, strict=True)):
            nbytes = n * page
            if nbytes <= 0:
                raise ValueError(f"slot {s}: {n} blocks x {page} bytes is empty")
            fd = os.memfd_create(f"kvfleet-{self.name}-slot{s}")
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                os.close(fd)
                need = f"{nbytes / 2**20:.1f} MiB"
                raise TransferError(f"slot {s}: cannot reserve {need} of shared memory: {e}") from e
            buf = mmap.mmap(fd, nbytes)
            tensor = torch.frombuffer(buf, dtype=torch.uint8).view(n, page)
            self._memfds[tensor.data_ptr()] = (fd, nbytes)
            slots.append(tensor)
        return slots

    def _register(self, tensors: list[torch.Tensor], rows: tuple[int, ...], page_bytes: tuple[int, ...]) -> AgentInfo:
        on_gpu = tensors[0].device.type == "cuda"
        paths: list[str] = []
        cuda_ipc: tuple = ()
        for s, t in enumerate(tensors):
            if on_gpu:
                ours = t.data_ptr() in self._cuda_slots
            else:
                fd, nbytes = self._memfds.get(t.data_ptr(), (-1, 0))
                ours = fd >= 0 and nbytes == t.numel() * t.element_size()
                paths.append(f"/proc/{os.getpid()}/fd/{fd}")
            if not ours:
                raise TransferError(
                    f"slot tensor {s}: the local backend shares memory it allocated itself; "
                    "create the slot tensors with allocate_slots()"
                )
        if on_gpu:
            from engine.transfer import local_cuda

            cuda_ipc = local_cuda.share(self.name, list(tensors))
            self._local = list(tensors)
        else:
            self._local = [t.numpy() for t in tensors]  # uint8 [num_blocks, page] views of our memfds
        address = f"\0kvfleet-notify-{os.getpid()}-{uuid.uuid4().hex}".encode()  # < 108 bytes
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        listener.setblocking(False)
        self._listener = listener
        return AgentInfo(
            backend=self.backend,
            name=self.name,
            num_blocks=rows[0],
            page_bytes=page_bytes,
            host=_host_id(),
            pid=os.getpid(),
            mem_type="VRAM" if on_gpu else "DRAM",
            device_id=(tensors[0].device.index or 0) if on_gpu else 0,
            shm_paths=tuple(paths),
            notify_addr=address,
            cuda_ipc=cuda_ipc,
        )

    # -- peers -------------------------------------------------------------------------------
    def _add_peer(self, info: AgentInfo) -> None:
        if info.host != _host_id():
            raise TransferError(f"peer {info.name!r} is on host {info.host!r}; the local backend needs one host")
        on_gpu = info.mem_type == "VRAM"
        if on_gpu != (self.agent_info.mem_type == "VRAM"):
            raise TransferError(
                f"peer {info.name!r} has its slots in {info.mem_type}, this worker in {self.agent_info.mem_type}: "
                "the local backend copies between slots of the same kind (both on CPU or both on CUDA)"
            )
        if not on_gpu and len(info.shm_paths) != info.num_slots:
            raise TransferError(f"peer {info.name!r}: AgentInfo lacks shared-memory paths")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(info.notify_addr)  # first: a live listener proves the paths / IPC handles are the owner's
            sock.setblocking(False)
            slots: list[torch.Tensor] | list[np.ndarray]
            if on_gpu:
                from engine.transfer import local_cuda

                slots = local_cuda.open_peer(info)
            else:
                slots = [
                    self._map(path, info.rows_of(s), page)
                    for s, (path, page) in enumerate(zip(info.shm_paths, info.page_bytes, strict=True))
                ]
        except TransferError:
            sock.close()
            raise
        except OSError as e:
            sock.close()
            raise TransferError(f"peer {info.name!r} unreachable: {e}") from e
        self._peer_socks[info.name] = sock
        self._peer_slots[info.name] = slots

    @staticmethod
    def _map(path: str, num_blocks: int, page: int) -> np.ndarray:
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != num_blocks * page:
                raise OSError(errno.EINVAL, f"{path}: size {os.fstat(fd).st_size} != {num_blocks} x {page}")
            buf = mmap.mmap(fd, num_blocks * page, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return np.frombuffer(buf, dtype=np.uint8).reshape(num_blocks, page)

    def _remove_peer(self, name: str) -> None:
        self._peer_slots.pop(name, None)  # the mappings go with the last array referencing them
        sock = self._peer_socks.pop(name, None)
        if sock is not None:
            sock.close()

    # -- reads -------------------------------------------------------------------------------
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
        runs = {  # per pool: its pairs as runs of consecutive rows
            p: copy_runs(remote_ids[pool_ids == p], local_ids[pool_ids == p]) for p in np.unique(pool_ids).tolist()
        }
        rec.setup_s = time.perf_counter() - t0
        if not self._owner_alive(peer.name):
            rec.status, rec.error = FAILED, f"owner {peer.name} gone (notification socket closed)"
            return
        local = self.agent_info
        if local.mem_type == "VRAM":
            from engine.transfer import local_cuda

            pools = [local.pool_of(s) for s in range(local.num_slots)]
            event = local_cuda.copy_rows(self._peer_slots[peer.name], self._local, pools, runs)
            rec.handle = _PendingCopy(event, notify)
            self._progress(rec)
            return
        for s, (src, dst) in enumerate(zip(self._peer_slots[peer.name], self._local, strict=True)):
            for r0, l0, n in runs.get(local.pool_of(s), ()):
                dst[l0 : l0 + n] = src[r0 : r0 + n]
        rec.handle = notify
        self._notify(rec)

    def _progress(self, rec: ReadRecord) -> None:
        if isinstance(rec.handle, _PendingCopy):
            if not rec.handle.event.query():
                return  # still copying: neither done nor notified
            rec.handle = rec.handle.notify
        self._notify(rec)

    def _owner_alive(self, name: str) -> bool:
        """The owner never writes to our socket: EOF (or an error) means it closed or died."""
        try:
            return self._peer_socks[name].recv(1, socket.MSG_PEEK) != b""
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def _notify(self, rec: ReadRecord) -> None:
        """Deliver the pending notification (``rec.handle``); DONE once the owner has it."""
        if not rec.handle:
            rec.status = DONE
            return
        sock = self._peer_socks.get(rec.peer)
        if sock is None:
            rec.status, rec.error = FAILED, f"peer {rec.peer} removed"
            return
        try:
            sock.send(rec.handle)
        except BlockingIOError:
            rec.status = PENDING  # owner's buffer is full; retried by poll until the deadline
            return
        except OSError as e:
            rec.status, rec.error = FAILED, f"owner {rec.peer} gone: {e}"
            return
        rec.handle = None
        rec.status = DONE

    def _cancel(self, rec: ReadRecord) -> None:
        if isinstance(rec.handle, _PendingCopy):
            try:
                rec.handle.event.synchronize()  # a queued copy must not land after its blocks are given back
            except RuntimeError as e:  # a CUDA error: it is sticky, the engine's next kernel raises it too
                logger.error("%s: waiting for the copy of a cancelled read from %s failed: %s", self.name, rec.peer, e)
        rec.handle = None

    def owner_notifications(self) -> list[bytes]:
        if self._listener is None:
            return []
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            conn.setblocking(False)
            self._conns.append(conn)
        out: list[bytes] = []
        alive = []
        for conn in self._conns:
            try:
                while msg := conn.recv(1 << 16):
                    out.append(msg)
            except (BlockingIOError, InterruptedError):
                alive.append(conn)
                continue
            except OSError:
                pass
            conn.close()  # recv returned b"": the reader closed its side
        self._conns = alive
        return out

    # -- shutdown ----------------------------------------------------------------------------
    def _close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._conns = []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for fd, _ in self._memfds.values():
            os.close(fd)  # our tensors keep their mappings; new peers can no longer map them
        self._memfds.clear()
        if self._cuda_slots:
            from engine.transfer import local_cuda

            local_cuda.unshare(self.name)  # same-process readers find us no more (the socket is closed too)
            self._cuda_slots.clear()
        self._local = []
