"""CUDA slot memory for the local backend (``local.py``): allocation, sharing through CUDA IPC,
opening a peer's slots and the row copies of a read.

Sharing
    ``share`` runs torch's own CUDA IPC reduction (``torch.multiprocessing.reductions.reduce_tensor``,
    i.e. ``UntypedStorage._share_cuda_``) on every slot and keeps the plain part of its result
    (allocation handle, offsets, ref-counter file, the IPC event of the writes before sharing)
    in ``AgentInfo.cuda_ipc``, with the GPU's UUID: a reader whose ``CUDA_VISIBLE_DEVICES``
    numbers the GPU differently still finds it. ``open_peer`` rebuilds the tensors with
    ``rebuild_cuda_tensor``, which opens each allocation once per process and makes the
    reader's stream wait for that event.

    torch counts one expected consumer per share in a shared-memory counter (a reader's close
    takes one off) and keeps the storage from being freed while the count is above zero. An
    AgentInfo serves any number of readers, none included, so the owner takes its one count
    off at once: its slots are freed with its tensors, as on CPU (a reader that outlives the
    owner finds the owner's socket closed and fails its reads; see ``local.py``). torch
    2.11-2.13 read that counter as unsigned: once a reader in another process has closed its
    mapping, the owner's slots, when dropped, stay in torch's "limbo" until the owner's process
    exits (owners live as long as their worker; owners read only in their own process are freed
    normally).

    CUDA IPC cannot open a handle in the process that made it, so a reader in the owner's
    process takes the owner's tensors from ``_IN_PROCESS`` (keyed by the unique agent name).

Copies
    A read copies on the reader's current stream of its slots' device (the engine's compute
    stream), so it lands after any kernel this process queued on those blocks before, and
    every later kernel sees it; with an owner in this process on the same device, after the
    owner's queued writes too. ``copy_rows`` returns an event recorded after the copies;
    ``local.py`` reports the read done, and notifies the owner, only once it has completed.
    An owner in another process must have finished writing the blocks it exports (its stream
    synchronized) before the handle leaves it: nothing orders this process's copy after
    another process's kernels.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from engine.transfer.pairs import TransferError
from engine.transfer.records import AgentInfo

# Slot tensors of every CUDA owner registered in this process, by agent name: a same-process
# reader's only way to them (CUDA IPC refuses handles opened by their own process). Weak: an
# owner dropped without close() does not keep its slots here.
_IN_PROCESS: dict[str, list[weakref.ref[torch.Tensor]]] = {}

# A pool whose pairs form more runs than this is copied with one gather/scatter per slot
# (index_select + index_copy_) instead of one slice copy per run.
MAX_SLICE_RUNS = 4

_IPC_ARGS = 15  # rebuild_cuda_tensor's arguments (torch 2.x)


def allocate(rows: Sequence[int], page_bytes: Sequence[int], device: str | torch.device) -> list[torch.Tensor]:
    """Zeroed ``[rows[s], page_bytes[s]]`` uint8 tensors on a CUDA device."""
    if not torch.cuda.is_available():
        raise TransferError(
            f"local transfer backend: CUDA slot memory requested (device {str(device)!r}) "
            "but torch.cuda.is_available() is False"
        )
    dev = torch.device(device)
    dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    slots = []
    for s, (n, page) in enumerate(zip(rows, page_bytes, strict=True)):
        if n * page <= 0:
            raise ValueError(f"slot {s}: {n} blocks x {page} bytes is empty")
        try:
            slots.append(torch.zeros(n, page, dtype=torch.uint8, device=dev))
        except torch.cuda.OutOfMemoryError as e:
            raise TransferError(f"slot {s}: cannot allocate {n * page / 2**20:.1f} MiB on {dev}: {e}") from e
    return slots


def device_uuid(index: int) -> str:
    """The GPU's UUID (the same in every process, whatever its index there)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:
        raise TransferError(f"torch {torch.__version__} does not report GPU UUIDs; local_cuda.py needs updating")
    return str(uuid)


def share(name: str, tensors: list[torch.Tensor]) -> tuple[tuple[int | bytes | str, ...], ...]:
    """Register ``tensors`` for same-process readers and return, per slot, the plain data a
    reader in another process needs to open it: ``(device uuid, device index, handle, storage
    bytes, storage offset in the allocation, tensor offset in the storage, ref-counter file,
    ref-counter offset, event handle, event sync required)``."""
    uuid = device_uuid(tensors[0].device.index or 0)
    out = []
    for s, t in enumerate(tensors):
        try:
            rebuild, args = reduce_tensor(t)
        except RuntimeError as e:
            raise TransferError(f"slot tensor {s}: torch cannot share it through CUDA IPC: {e}") from e
        if rebuild is not rebuild_cuda_tensor or len(args) != _IPC_ARGS:
            got = getattr(rebuild, "__name__", rebuild)
            raise TransferError(
                f"slot tensor {s}: torch {torch.__version__} reduce_tensor returned {got} with {len(args)} "
                f"arguments, not rebuild_cuda_tensor with {_IPC_ARGS}; local_cuda.py needs updating"
            )
        tensor_offset = args[3]
        device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset, event_handle, event_sync = args[6:]
        if not isinstance(handle, bytes) or not isinstance(ref_handle, bytes) or not isinstance(event_handle, bytes):
            raise TransferError(f"slot tensor {s}: torch returned no CUDA IPC handle (an empty storage?)")
        try:  # take off the count of the one consumer torch expects (see the module docstring)
            torch.UntypedStorage._release_ipc_counter_cuda(ref_handle, ref_offset)
        except RuntimeError as e:
            raise TransferError(f"slot tensor {s}: cannot release its CUDA IPC ref count: {e}") from e
        out.append(
            (
                uuid,
                int(device),
                handle,
                int(size_bytes),
                int(offset_bytes),
                int(tensor_offset),
                ref_handle,
                int(ref_offset),
                event_handle,
                int(bool(event_sync)),
            )
        )
    _IN_PROCESS[name] = [weakref.ref(t) for t in tensors]
    return tuple(out)


def unshare(name: str) -> None:
    _IN_PROCESS.pop(name, None)


def local_index(uuid: str, index: int) -> int:
    """This process's index of the GPU the owner calls ``index`` (same UUID)."""
    count = torch.cuda.device_count()
    for i in range(count):
        if device_uuid(i) == uuid:
            return i
    raise TransferError(f"the owner's GPU {index} ({uuid}) is not visible in this process ({count} GPUs visible)")


def open_peer(info: AgentInfo) -> list[torch.Tensor]:
    """The owner's slot tensors, opened in this process (its own tensors if it lives here)."""
    if info.pid == os.getpid():
        slots = [ref() for ref in _IN_PROCESS.get(info.name, ())]
        if not slots or any(t is None for t in slots):
            raise TransferError(f"peer {info.name!r} lives in this process but its CUDA slots are gone (closed?)")
        return slots  # type: ignore[return-value]  # no None is left: checked just above
    if len(info.cuda_ipc) != info.num_slots:
        raise TransferError(
            f"peer {info.name!r}: AgentInfo has {len(info.cuda_ipc)} CUDA IPC descriptors for {info.num_slots} slots"
        )
    if not torch.cuda.is_available():
        raise TransferError(f"peer {info.name!r} has its slots on a GPU; torch.cuda.is_available() is False here")
    index = local_index(str(info.cuda_ipc[0][0]), int(info.cuda_ipc[0][1]))
    out = []
    for s, desc in enumerate(info.cuda_ipc):
        _, _, handle, size_bytes, offset_bytes, tensor_offset, ref_handle, ref_offset, event_handle, event_sync = desc
        rows, page = info.rows_of(s), info.page_bytes[s]
        if int(tensor_offset) + rows * page > int(size_bytes):
            raise TransferError(
                f"peer {info.name!r}: slot {s} ({rows} x {page} bytes) exceeds its shared storage "
                f"({int(size_bytes)} bytes)"
            )
        try:
            t = rebuild_cuda_tensor(
                torch.Tensor,
                torch.Size((rows, page)),
                (page, 1),
                int(tensor_offset),
                torch.storage.TypedStorage,
                torch.uint8,
                index,
                handle,
                int(size_bytes),
                int(offset_bytes),
                False,
                ref_handle,
                int(ref_offset),
                event_handle,
                bool(event_sync),
            )
        except (RuntimeError, TypeError, ValueError) as e:
            raise TransferError(f"peer {info.name!r}: cannot open its CUDA slot {s} through CUDA IPC: {e}") from e
        out.append(t)
    return out


def copy_rows(
    src_slots: Sequence[torch.Tensor],
    dst_slots: Sequence[torch.Tensor],
    slot_pools: Sequence[int],
    runs: dict[int, list[tuple[int, int, int]]],
) -> torch.cuda.Event:
    """Queue the copy of every run ``(remote_start, local_start, length)`` of each slot's pool
    from ``src_slots`` into ``dst_slots`` on the current stream of the destination device;
    return an event recorded after the copies."""
    device = dst_slots[0].device
    indices: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.cuda.device(device):
        for src, dst, pool in zip(src_slots, dst_slots, slot_pools, strict=True):
            pool_runs = runs.get(pool, ())
            if len(pool_runs) <= MAX_SLICE_RUNS:
                for r0, l0, n in pool_runs:
                    dst[l0 : l0 + n].copy_(src[r0 : r0 + n], non_blocking=True)
                continue
            key = (pool, src.device)
            if key not in indices:
                remote = np.concatenate([np.arange(r0, r0 + n) for r0, _, n in pool_runs])
                local = np.concatenate([np.arange(l0, l0 + n) for _, l0, n in pool_runs])
                # pinned + non_blocking: a pageable upload would wait for everything queued on
                # the stream first, stalling this (reader's) host thread behind its own kernels
                indices[key] = (
                    torch.from_numpy(remote).pin_memory().to(src.device, non_blocking=True),
                    torch.from_numpy(local).pin_memory().to(device, non_blocking=True),
                )
            remote_idx, local_idx = indices[key]
            rows = src.index_select(0, remote_idx)
            dst.index_copy_(0, local_idx, rows.to(device, non_blocking=True))
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    return event
