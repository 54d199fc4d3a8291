"""HostKVMemory: the host tier's memory and the copies between it and the device slot tensors.

The coordinator's host tier (``engine.kv_cache.host_tier``) decides which blocks move where; this
object owns the host copies of the slot tensors (``[host_blocks_p, page_bytes_p]`` per slot of
every pool ``p``, as the device's, ``engine.model.kv_layout``) and runs the ``TierCopy`` batches
in order. On CUDA the host tensors are pinned and the copies run on a side stream that first
waits for the work queued on the compute stream (an offload reads what earlier steps wrote), and
the compute stream waits for them before the next forward, so the host thread never blocks on
them; on the CPU they are plain copies (the same bookkeeping, so CI exercises it).

On the CPU a batch is one call that copies its rows of every slot of the pool (``copy_rows`` of
the compiled ``engine._row_copy``: indices checked once, then one memmove per row and slot),
else, where that extension was not built, one numpy gather and scatter per slot. The host
tier's queue makes batches large (one per pool and direction per phase of an engine step), so a
promote moves its bytes near memcpy speed rather than paying a tensor operation per block and
slot (``benchmarks/promote_bandwidth.py`` measures it).

For a fair measure of that (``kv_cache.offload.measure_memcpy``, what ``benchmarks/tiered_bench.py``
turns on), each promote batch is followed by a plain copy of the same number of bytes in the same
process, timed the same way (``time_reference_copies``): on the CPU a contiguous memcpy between
two buffers of this object; on CUDA a pinned host buffer copied to a device buffer asynchronously
on the side stream, the stream synchronised after the promote batch and after the copy, so both
times are transfers, not the time to queue them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.kv_cache.host_tier import TierCopy
from engine.model.kv_layout import KVLayout

log = logging.getLogger(__name__)

#: (targets, sources, target rows, source rows): row ``target_rows[j]`` of every target buffer
#: receives row ``source_rows[j]`` of its source (``engine/_row_copy.c``); None where the
#: extension was not built (setup.py: optional), and numpy copies the rows
copy_rows: Callable[[Sequence[np.ndarray], Sequence[np.ndarray], list[int], list[int]], None] | None
try:
    from engine._row_copy import copy_rows as _compiled_copy_rows

    copy_rows = _compiled_copy_rows
except ImportError:
    copy_rows = None


class HostKVMemory:
    """Host slot tensors mirroring a runner's device slots, and the copies between them.

    Invariant: ``host[i]`` has the page size of ``device[i]`` and row ``b`` is host block ``b`` of
    that slot's pool; copies run in the order given, each batch after the one before it.
    """

    def __init__(self, layout: KVLayout, device_slots: Sequence[torch.Tensor], host_blocks: Sequence[int]):
        self.layout = layout
        self.device_slots = list(device_slots)
        self.cuda = self.device_slots[0].device.type == "cuda"
        self.host = [
            torch.zeros(host_blocks[p], slot.shape[1], dtype=slot.dtype, pin_memory=self.cuda)
            for p, slot in zip(layout.slot_pool, self.device_slots, strict=True)
        ]
        self.stream = torch.cuda.Stream(device=self.device_slots[0].device) if self.cuda else None
        # on the CPU: numpy views of each pool's device and host slot tensors, rows as the widest
        # integers that tile them (the same memory), what the row copies work on
        self.device_rows: list[list[np.ndarray]] = []
        self.host_rows: list[list[np.ndarray]] = []
        # bytes one block of each pool holds over its slots (what copying it moves)
        self.pool_block_bytes = [
            sum(self.host[s].shape[1] * self.host[s].element_size() for s in self._slots_of(p))
            for p in range(layout.num_pools)
        ]
        if not self.cuda:
            for p in range(layout.num_pools):
                slots = self._slots_of(p)
                self.device_rows.append([_wide_rows(self.device_slots[s]) for s in slots])
                self.host_rows.append([_wide_rows(self.host[s]) for s in slots])
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        # host-side seconds spent in ``run`` (on CUDA: queueing the copies, not their transfer),
        # in all and per direction (offloads to the host, promotes to the device)
        self.seconds = 0.0
        self.seconds_to_host = 0.0
        self.seconds_to_device = 0.0
        # the same-process reference copies next to the promotes (``time_reference_copies``): on
        # or off, their buffers (grown to the largest batch) and what they moved in how long
        self.reference = False
        self.reference_source: torch.Tensor | None = None
        self.reference_target: torch.Tensor | None = None
        self.memcpy_bytes = 0
        self.memcpy_seconds = 0.0
        how = "by compiled row copies" if copy_rows is not None else "by numpy row copies (engine._row_copy not built)"
        log.info("host tier memory: %.1f MiB, copies %s", self.nbytes / 2**20, "on a side stream" if self.cuda else how)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host)

    def block_bytes(self, pool: int) -> int:
        """Bytes one block of ``pool`` holds over all its slots (what a copy of it moves)."""
        return self.pool_block_bytes[pool]

    #: copies measured before the measured bandwidth replaces the default (smaller samples are
    #: mostly call overhead)
    MEASURED_BYTES = 1 << 20

    def bandwidth(self, default: float) -> float:
        """Bytes per second the copies ran at (``default`` until ``MEASURED_BYTES`` were copied;
        on CUDA host-side seconds, the time to queue them, bound it from above)."""
        moved = self.bytes_to_host + self.bytes_to_device
        if moved < self.MEASURED_BYTES or self.seconds <= 0:
            return default
        return moved / self.seconds

    def time_reference_copies(self) -> None:
        """From now on, follow each promote batch by a plain copy of its bytes in this process,
        timed into ``memcpy_bytes`` / ``memcpy_seconds`` (on CUDA both the batch and the copy are
        waited for: the promote seconds become transfer times)."""
        self.reference = True

    def _reference_copy(self, nbytes: int) -> None:
        """One plain copy of ``nbytes`` (CPU: between two contiguous buffers; CUDA: from pinned
        host memory to the device, asynchronously on the side stream, then waited for)."""
        if nbytes <= 0:
            return
        if self.reference_source is None or self.reference_source.numel() < nbytes:
            size = max(nbytes, 1 << 20)
            device = self.device_slots[0].device
            self.reference_source = torch.ones(size, dtype=torch.uint8, pin_memory=self.cuda)
            self.reference_target = torch.empty(size, dtype=torch.uint8, device=device)
        source, target = self.reference_source[:nbytes], self.reference_target
        assert target is not None
        start = time.perf_counter()
        if self.stream is not None:
            target[:nbytes].copy_(source, non_blocking=True)
            self.stream.synchronize()
        else:
            np.copyto(target[:nbytes].numpy(), source.numpy())
        self.memcpy_seconds += time.perf_counter() - start
        self.memcpy_bytes += nbytes

    def _slots_of(self, pool: int) -> range:
        first = self.layout.slot_index(pool, 0)
        return range(first, first + self.layout.pools[pool].num_slots)

    @torch.inference_mode()
    def run(self, copies: list[TierCopy]) -> None:
        """Run the batches in order (on CUDA: queued on the side stream, the compute stream waits)."""
        if not copies:
            return
        start = time.perf_counter()
        if self.stream is None:
            self._copy_all(copies)
        else:
            compute = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                self._copy_all(copies)
            compute.wait_stream(self.stream)
        self.seconds += time.perf_counter() - start

    def _copy_all(self, copies: list[TierCopy]) -> None:
        """The batches in order, each one's seconds counted to its direction."""
        for copy in copies:
            start = time.perf_counter()
            self._copy(copy)
            if copy.to_host:
                self.seconds_to_host += time.perf_counter() - start
                continue
            if self.reference and self.stream is not None:
                self.stream.synchronize()  # a transfer time, as the reference copy's
            self.seconds_to_device += time.perf_counter() - start
            if self.reference:
                self._reference_copy(self.pool_block_bytes[copy.pool] * len(copy.device_ids))

    def _copy(self, copy: TierCopy) -> None:
        """One batch: on CUDA, slice copies over runs of consecutive ids (asynchronous: the host
        rows are pinned, the stream orders them); on the CPU, its rows of every slot at once."""
        if self.cuda:
            slots = self._slots_of(copy.pool)
            for device_start, host_start, n in _runs(copy.device_ids, copy.host_ids):
                for s in slots:
                    device = self.device_slots[s][device_start : device_start + n]
                    host = self.host[s][host_start : host_start + n]
                    if copy.to_host:
                        host.copy_(device, non_blocking=True)
                    else:
                        device.copy_(host, non_blocking=True)
        elif copy.to_host:
            _copy_rows(self.host_rows[copy.pool], self.device_rows[copy.pool], copy.host_ids, copy.device_ids)
        else:
            _copy_rows(self.device_rows[copy.pool], self.host_rows[copy.pool], copy.device_ids, copy.host_ids)
        moved = self.pool_block_bytes[copy.pool] * len(copy.device_ids)
        if copy.to_host:
            self.bytes_to_host += moved
        else:
            self.bytes_to_device += moved


def _copy_rows(
    targets: list[np.ndarray], sources: list[np.ndarray], target_ids: list[int], source_ids: list[int]
) -> None:
    """Row ``target_ids[j]`` of every target receives row ``source_ids[j]`` of its source (no
    target row repeats, so the order of the copies does not matter)."""
    if copy_rows is not None:
        copy_rows(targets, sources, target_ids, source_ids)
        return
    target_index, source_index = np.asarray(target_ids), np.asarray(source_ids)
    for target, source in zip(targets, sources, strict=True):
        target[target_index] = source[source_index]


def _runs(device_ids: list[int], host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(device start, host start, length) of the maximal runs where both ids go up by one."""
    runs: list[tuple[int, int, int]] = []
    for d, h in zip(device_ids, host_ids, strict=True):
        if runs:
            d0, h0, n = runs[-1]
            if d == d0 + n and h == h0 + n:
                runs[-1] = (d0, h0, n + 1)
                continue
        runs.append((d, h, 1))
    return runs


def _wide_rows(slot: torch.Tensor) -> np.ndarray:
    """``slot`` ([blocks, page], on the CPU) as a numpy array of rows of the widest integer type
    that tiles a row's bytes (the same memory: a copy of rows is a copy of pages)."""
    raw = slot.view(torch.uint8).numpy()
    for dtype in (np.int64, np.int32, np.int16):
        size = np.dtype(dtype).itemsize
        if raw.shape[1] % size == 0 and raw.ctypes.data % size == 0:
            return raw.view(dtype)
    return raw
