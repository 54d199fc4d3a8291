"""HostKVMemory: the host tier's memory and the copies between it and the device slot tensors.

The coordinator's host tier (``engine.kv_cache.host_tier``) decides which blocks move where; this
object owns the host copies of the slot tensors (``[host_blocks_p, page_bytes_p]`` per slot of
every pool ``p``, as the device's, ``engine.model.kv_layout``) and runs the ``TierCopy`` batches
in order. On CUDA the host tensors are pinned and the copies run on a side stream that first
waits for the work queued on the compute stream (an offload reads what earlier steps wrote), and
the compute stream waits for them before the next forward, so the host thread never blocks on
them; on the CPU they are plain copies (the same bookkeeping, so CI exercises it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.kv_cache.host_tier import TierCopy
from engine.model.kv_layout import KVLayout

#: pages smaller than this move, on the CPU, by gather and scatter rather than one copy per block
#: (measured on a 2-core CPU, 256 scattered blocks x 8 slots: 256 B pages 0.03 -> 0.6 GB/s,
#: 2 KiB 0.12-0.2 -> 0.8-1.0 GB/s; 32 KiB pages 1.9-2.6 GB/s by per-block copies, 0.7-1.8 by gather)
GATHER_BELOW_BYTES = 16 * 1024


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
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        # host-side seconds spent in ``run`` (on CUDA: queueing the copies, not their transfer),
        # in all and per direction (offloads to the host, promotes to the device)
        self.seconds = 0.0
        self.seconds_to_host = 0.0
        self.seconds_to_device = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host)

    def block_bytes(self, pool: int) -> int:
        """Bytes one block of ``pool`` holds over all its slots (what a copy of it moves)."""
        return sum(self.host[s].shape[1] * self.host[s].element_size() for s in self._slots_of(pool))

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
            else:
                self.seconds_to_device += time.perf_counter() - start

    def _copy(self, copy: TierCopy) -> None:
        """One batch. On CUDA: slice copies over runs of consecutive ids (asynchronous: the host
        rows are pinned, the stream orders them). On the CPU, a batch of scattered ids on small
        pages (``GATHER_BELOW_BYTES``) is one gather and one scatter per slot over rows viewed as
        the widest integers that tile them: there one call per block and slot costs more than
        its bytes, while large pages copy faster in one pass each."""
        cuda, slots = self.cuda, self._slots_of(copy.pool)
        runs = _runs(copy.device_ids, copy.host_ids)
        if not cuda and len(runs) > 1 and self.host[slots[0]][0].nbytes < GATHER_BELOW_BYTES:
            device_ids, host_ids = torch.tensor(copy.device_ids), torch.tensor(copy.host_ids)
            for s in slots:
                device, host = _wide_rows(self.device_slots[s]), _wide_rows(self.host[s])
                if copy.to_host:
                    host.index_copy_(0, host_ids, device.index_select(0, device_ids))
                else:
                    device.index_copy_(0, device_ids, host.index_select(0, host_ids))
        else:
            for device_start, host_start, n in runs:
                for s in slots:
                    device = self.device_slots[s][device_start : device_start + n]
                    host = self.host[s][host_start : host_start + n]
                    if copy.to_host:
                        host.copy_(device, non_blocking=cuda)
                    else:
                        device.copy_(host, non_blocking=cuda)
        moved = sum(self.host[s].shape[1] for s in self._slots_of(copy.pool)) * len(copy.device_ids)
        if copy.to_host:
            self.bytes_to_host += moved
        else:
            self.bytes_to_device += moved


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


def _wide_rows(slot: torch.Tensor) -> torch.Tensor:
    """``slot`` ([blocks, page]) viewed as rows of the widest integer type that tiles a row's bytes
    (the same memory: a copy of rows is a copy of pages)."""
    raw = slot.view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if raw.shape[1] % size == 0 and raw.storage_offset() % size == 0:
            return raw.view(dtype)
    return raw
