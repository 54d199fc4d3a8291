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
        # host-side seconds spent in ``run`` (on CUDA: queueing the copies, not their transfer)
        self.seconds = 0.0

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
            for copy in copies:
                self._copy(copy)
        else:
            compute = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                for copy in copies:
                    self._copy(copy)
            compute.wait_stream(self.stream)
        self.seconds += time.perf_counter() - start

    def _copy(self, copy: TierCopy) -> None:
        """One batch, as slice copies over runs of consecutive ids (asynchronous on CUDA: the host
        rows are pinned, the stream orders them)."""
        cuda = self.cuda
        for device_start, host_start, n in _runs(copy.device_ids, copy.host_ids):
            for s in self._slots_of(copy.pool):
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
