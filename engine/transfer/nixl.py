"""NIXL (UCX backend) transport: the decode worker READs block rows straight out of the prefill
worker's registered slot tensors. DRAM on CPU hosts, VRAM on GPUs; ``nixl`` is imported lazily.

How it is wired
    * ``register`` registers the slot tensors with the agent, then prepares ONE local descriptor
      list, block-indexed: descriptor ``offset[s] + b`` is row ``b`` of slot tensor ``s``
      (``offset[s]``: the rows of the slots before ``s``; slots of different pools have their
      own row counts). A pair of pool ``p`` names one descriptor in every slot of pool ``p``.
      The AgentInfo carries the agent metadata blob plus the slots' base addresses and page sizes.
    * ``add_peer`` loads the peer's metadata and prepares the peer's descriptor list the same
      way, from its base addresses (no per-request descriptor building).
    * ``start_read`` turns the pairs into two index arrays (numpy, vectorised over slots) and
      calls ``make_prepped_xfer`` + ``transfer`` with ``notify`` as the NIXL notification, which
      the owner collects with ``owner_notifications()`` (``get_new_notifs``).

Progress thread and memory (2-core VM shared with other jobs, so ranges; ``--sweep`` of
benchmarks/transfer_bandwidth.py: 256 MiB contiguous / 512 x 64 KiB scattered, GB/s)
    * NIXL's Python wrapper creates agents with ``pthrDelay = 0``: the UCX progress thread then
      polls with a zero timeout and burns a whole core even when idle (2.0 s CPU per 2 s idle).
      We create agents with a non-zero delay (``progress_delay_us``, default 1000): the thread
      sleeps in ``poll()`` on the worker's event fd and wakes on traffic; idle cost ~0.02 s/2 s.
    * 4 KiB pages, owner thread (1 ms) / reader none: 4.6-6.0 contiguous, 4.2-4.9 scattered;
      owner and reader threads: 2.3-3.0 / 1.6-3.0 (the reader's thread fights its own polling
      for the UCX worker); owner thread with the stock 0 delay: 2.3-2.9 / 2.0-2.9.
    * Huge pages (``allocate_slots``), owner thread (1 ms) / reader none: 7.3-8.3 / 5.3-6.9,
      in-process copy of the same bytes 10.5-15 / 7.4-8.5. Owner and reader threads: 3.4 /
      2.3. Stock 0 delay owner: 7.4 / 6.2 (same speed, but a core burnt forever). No threads,
      owner polling ``owner_notifications()`` every 1 ms: 6.0 / 2.9. Raw ``process_vm_readv``
      of 256 MiB is ~8.3 GB/s single-threaded here, so reads run at the kernel's ceiling.
    * Both off hangs: the first read to a peer needs the owner's UCX worker to answer the
      connection wire-up; if the owner never calls into NIXL the reader's ``check_xfer_state``
      returns PROC forever (reproduced). Reads of an established connection do not need the
      owner (UCX moves DRAM with ``cma``, i.e. ``process_vm_readv`` by the reader).
    => ``role="owner"|"both"``: progress thread on with a 1 ms poll delay; ``role="reader"``:
       off (the reader progresses its worker itself in ``poll``). Every wait is bounded anyway.
    * CPU slots from ``allocate_slots`` sit on transparent huge pages: ``cma`` pins and copies
      page by page, and 2 MiB pages made reads ~1.5x faster (see ``hugepage_zeros``).
    * With ``cma`` a CPU read is synchronous: ``transfer`` returns after copying, so the engine
      loop blocks for the copy (about 8 ms for 64 MiB); on GPUs (``cuda_ipc``/RDMA) reads are
      asynchronous and ``poll`` matters.
    * One thread only: the agent is created with NIXL's default (unsynchronised) thread mode;
      posting from two threads at once hung in a probe.

Failures
    * A dead peer: ``transfer`` or ``check_xfer_state`` raise ``nixlRemoteDisconnectError`` ->
      "failed" at once. A frozen peer (SIGSTOP) before the connection exists: PROC until the
      deadline -> "failed" (and the handle is released, which cancels it).
    * ``UCX_NET_DEVICES`` is set from ``transfer.ucx_net_devices`` before the agent (and UCX)
      is created; it is process-wide. ``UCX_TLS=shm,cma,self`` would need a backend created
      with ``ucx_error_handling_mode=none``: we keep UCX's default transports.
    * UCX prints "Connection refused" errors to stderr when a peer went away; they are noise.
    * Importing nixl installs a handler that logs INFO lines to stdout; unless NIXL_LOG_LEVEL
      is set we raise the "nixl" logger to WARNING (stdout carries benchmark JSON, CLI output).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.transfer.base import KVTransfer
from engine.transfer.pairs import TransferError
from engine.transfer.records import DONE, FAILED, AgentInfo, ReadRecord, Role

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_NIXL_STATE = {"DONE": DONE, "PROC": "pending", "ERR": FAILED}


def _block_descs(
    base_addrs: Sequence[int], page_bytes: Sequence[int], rows: Sequence[int], device_id: int
) -> np.ndarray:
    """``[sum(rows), 3]`` (address, length, device) rows: row ``offset[s] + b`` = block b of slot s."""
    out = []
    for base, page, n in zip(base_addrs, page_bytes, rows, strict=True):
        d = np.empty((n, 3), dtype=np.uint64)
        d[:, 0] = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(page)
        d[:, 1] = page
        d[:, 2] = device_id
        out.append(d)
    return np.concatenate(out)


def _slot_indices(info: AgentInfo, pool_ids: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
    """Descriptor indices of ``block_ids`` (each in pool ``pool_ids[i]``) in every slot of its
    pool, slot-major, as int32 for NIXL; the same order for two workers of one layout."""
    rows = [info.rows_of(s) for s in range(info.num_slots)]
    offsets = np.concatenate(([0], np.cumsum(rows)))[:-1]
    parts = [offsets[s] + block_ids[pool_ids == info.pool_of(s)] for s in range(info.num_slots)]
    indices: np.ndarray = np.concatenate(parts).astype(np.int32)
    return indices


def hugepage_zeros(num_blocks: int, page: int) -> torch.Tensor:
    """A zeroed, pre-faulted ``[num_blocks, page]`` uint8 CPU tensor on 2 MiB-aligned anonymous
    memory advised for transparent huge pages (plain pages where THP is off).

    ``process_vm_readv`` (UCX ``cma``) pins and copies page by page: with huge pages on both
    sides a 256 MiB read went from 5.6 to 8.3 GB/s here (scattered 64 KiB: 4.5 -> 6.9 GB/s);
    torch's allocator gives 4 KiB pages for these sizes.
    """
    import torch

    nbytes = num_blocks * page
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch
    start = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
    tensor = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=-start % _HUGE_PAGE)
    return tensor.view(num_blocks, page).zero_()  # fault the pages in now, not during a read


def _new_agent(api: Any, name: str, progress_thread: bool, progress_delay_us: int) -> Any:
    """A UCX agent; with a progress thread, one that sleeps ``progress_delay_us`` between polls.

    ``nixl_agent`` hard-codes ``pthrDelay = 0`` on the config it builds (a busy loop), so the
    binding's constructor is wrapped for the duration of this call to set our delay.
    """
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    bind = getattr(api, "nixlBind", None)
    real = getattr(bind, "nixlAgent", None)
    if not progress_thread or bind is None or real is None:
        if progress_thread:
            logger.warning("nixl: cannot set the progress-thread delay; its thread will spin a core")
        return api.nixl_agent(name, config)

    def with_delay(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = progress_delay_us
        return real(agent_name, agent_config)

    bind.nixlAgent = with_delay
    try:
        return api.nixl_agent(name, config)
    finally:
        bind.nixlAgent = real


class NixlTransfer(KVTransfer):
    """KV transfer over NIXL's UCX backend; see the module docstring for the measured choices."""

    backend = "nixl"

    def __init__(
        self,
        name: str | None = None,
        *,
        read_timeout_s: float = 10.0,
        ucx_net_devices: str = "lo",
        role: Role = "both",
        progress_thread: bool | None = None,
        progress_delay_us: int = 1000,
    ):
        super().__init__(f"{name or 'kvfleet'}-{uuid.uuid4().hex[:8]}", read_timeout_s)
        if ucx_net_devices:
            os.environ["UCX_NET_DEVICES"] = ucx_net_devices
        from nixl import _api as api  # lazy: hosts without NIXL use the local backend

        if "NIXL_LOG_LEVEL" not in os.environ:  # nixl logs INFO lines to *stdout* by default
            logging.getLogger("nixl").setLevel(logging.WARNING)
        self.progress_thread = role != "reader" if progress_thread is None else progress_thread
        self._agent = _new_agent(api, self.name, self.progress_thread, progress_delay_us)
        self._reg_descs: Any = None
        self._local_dlist: Any = None
        self._remote_dlists: dict[str, Any] = {}
        self._tensors: list[torch.Tensor] = []
        self._scratch_index = -1
        self._warming: set[str] = set()  # peers whose next read is a warm-up (``warm_up``)
        self._zombies: list[Any] = []  # handles whose release failed; retried later

    # -- memory ------------------------------------------------------------------------------
    def allocate_slots(
        self, num_blocks: int | Sequence[int], page_bytes: Sequence[int], device: str = "cpu"
    ) -> list[torch.Tensor]:
        """CPU: zeroed slots on transparent huge pages (``cma`` reads 1.5x faster); GPU: ``torch.zeros``."""
        import torch

        rows = [num_blocks] * len(page_bytes) if isinstance(num_blocks, int) else list(num_blocks)
        if torch.device(device).type != "cpu":
            return [
                torch.zeros((n, page), dtype=torch.uint8, device=device)
                for n, page in zip(rows, page_bytes, strict=True)
            ]
        return [hugepage_zeros(n, page) for n, page in zip(rows, page_bytes, strict=True)]

    def _register(self, tensors: list[torch.Tensor], rows: tuple[int, ...], page_bytes: tuple[int, ...]) -> AgentInfo:
        import torch

        on_gpu = tensors[0].device.type == "cuda"
        mem_type = "VRAM" if on_gpu else "DRAM"
        device_id = (tensors[0].device.index or 0) if on_gpu else 0
        # Scratch rows after the block descriptors, one per slot at that slot's page size: the
        # target of notification-only reads (row 0) and of warm-up reads (every row).
        scratch = torch.zeros((1, sum(page_bytes)), dtype=torch.uint8, device=tensors[0].device)
        self._reg_descs = self._agent.register_memory([*tensors, scratch])
        base_addrs = tuple(int(t.data_ptr()) for t in tensors)
        scratch_addrs = scratch.data_ptr() + np.concatenate(([0], np.cumsum(page_bytes)))[:-1]
        descs = np.concatenate(
            [
                _block_descs(base_addrs, page_bytes, rows, device_id),
                _block_descs([int(a) for a in scratch_addrs], page_bytes, [1] * len(page_bytes), device_id),
            ]
        )
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem_type)
        self._scratch_index = len(descs) - len(page_bytes)
        self._tensors = [*tensors, scratch]  # registered memory stays alive while the agent uses it
        return AgentInfo(
            backend=self.backend,
            name=self.name,
            num_blocks=rows[0],
            page_bytes=page_bytes,
            host=socket.gethostname(),
            pid=os.getpid(),
            metadata=bytes(self._agent.get_agent_metadata()),
            base_addrs=base_addrs,
            mem_type=mem_type,
            device_id=device_id,
        )

    # -- peers -------------------------------------------------------------------------------
    def _add_peer(self, info: AgentInfo) -> None:
        if len(info.base_addrs) != info.num_slots or not info.metadata:
            raise TransferError(f"peer {info.name!r}: AgentInfo lacks NIXL metadata or base addresses")
        try:
            loaded = self._agent.add_remote_agent(info.metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != info.name:
                raise TransferError(f"peer metadata names agent {loaded!r}, AgentInfo says {info.name!r}")
            rows = [info.rows_of(s) for s in range(info.num_slots)]
            descs = _block_descs(info.base_addrs, info.page_bytes, rows, info.device_id)
            self._remote_dlists[info.name] = self._agent.prep_xfer_dlist(info.name, descs, info.mem_type)
        except TransferError:
            raise
        except Exception as e:
            self._forget_remote(info.name)
            raise TransferError(f"peer {info.name!r}: {type(e).__name__}: {e}") from e

    def _remove_peer(self, name: str) -> None:
        dlist = self._remote_dlists.pop(name, None)
        if dlist is not None:
            try:
                dlist.release()
            except Exception as e:  # noqa: BLE001 - best effort: the peer is dropped either way
                logger.warning("%s: releasing descriptors of %s: %s", self.name, name, e)
        self._forget_remote(name)

    def _forget_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001 - the agent is already gone or was never loaded
            logger.debug("%s: remove_remote_agent(%s): %s", self.name, name, e)

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
        if peer.name in self._warming:
            # Warm-up: block 0 of every peer slot into our scratch rows. The first transfer that
            # touches a registered region pays the connection and that region's key setup
            # (measured: ~35-45 ms per first read of 8 slots), so touch them all now.
            slots = np.arange(peer.num_slots)
            rows = np.asarray([peer.rows_of(s) for s in range(peer.num_slots)])
            local_idx = (self._scratch_index + slots).astype(np.int32)
            remote_idx = np.concatenate(([0], np.cumsum(rows)))[:-1].astype(np.int32)
        elif local_ids.size == 0 and not notify:
            rec.status = DONE
            return
        elif local_ids.size == 0:
            # Notification only. ``send_notif`` to a peer not yet connected is dropped unless the
            # reader keeps progressing (seen: "AM send failed ... Request canceled"), so read
            # the peer's block 0 of slot 0 into our scratch row: its completion = delivery.
            local_idx, remote_idx = np.array([self._scratch_index], np.int32), np.zeros(1, np.int32)
        else:
            local_idx = _slot_indices(self.agent_info, pool_ids, local_ids)
            remote_idx = _slot_indices(peer, pool_ids, remote_ids)
        handle = self._agent.make_prepped_xfer(
            "READ", self._local_dlist, local_idx, self._remote_dlists[peer.name], remote_idx, notify
        )
        rec.handle = handle
        rec.setup_s = time.perf_counter() - t0
        self._set_state(rec, self._agent.transfer(handle))

    def warm_up(self, peer: AgentInfo) -> int:
        """Open the connection to ``peer`` now: add it and read its block 0 (its null block, never
        data) of every slot into this worker's scratch rows, so the first real read pays no
        setup. Returns the read's transfer id (poll and release it like any read)."""
        self._warming.add(peer.name)
        try:
            return self.start_read(peer, [])
        finally:
            self._warming.discard(peer.name)

    def _progress(self, rec: ReadRecord) -> None:
        self._set_state(rec, self._agent.check_xfer_state(rec.handle))
        self._retry_zombies()

    def _set_state(self, rec: ReadRecord, state: str) -> None:
        rec.status = _NIXL_STATE.get(state, FAILED)
        if rec.status == FAILED and rec.error is None:
            rec.error = f"NIXL transfer state {state}"

    def _cancel(self, rec: ReadRecord) -> None:
        handle, rec.handle = rec.handle, None
        if handle is None:
            return
        try:
            handle.release()  # cancels an in-flight request
        except Exception as e:  # noqa: BLE001 - a handle that will not release is kept and retried
            logger.warning("%s: releasing a transfer handle failed (%s); will retry", self.name, e)
            self._zombies.append(handle)

    def _retry_zombies(self) -> None:
        if not self._zombies:
            return
        left = []
        for handle in self._zombies:
            try:
                handle.release()
            except Exception:  # noqa: BLE001 - still busy: kept for the next retry
                left.append(handle)
        self._zombies = left

    def owner_notifications(self) -> list[bytes]:
        if self._closed:
            return []
        return [bytes(m) for msgs in self._agent.get_new_notifs().values() for m in msgs]

    # -- shutdown ----------------------------------------------------------------------------
    def _close(self) -> None:
        self._retry_zombies()
        if self._local_dlist is not None:
            self._local_dlist.release()
            self._local_dlist = None
        if self._reg_descs is not None:
            try:
                self._agent.deregister_memory(self._reg_descs)
            except Exception as e:  # noqa: BLE001 - closing goes on; the memory goes with the process
                logger.warning("%s: deregister_memory: %s", self.name, e)
            self._reg_descs = None
        self._tensors = []
