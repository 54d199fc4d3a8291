"""DecodeStep: decode-only steps from static, bucket-padded buffers, replayed as CUDA graphs.

A decode-only step (every chunk one token, past position 0, sampled) does not build its inputs
anew. Each request keeps a *slot*: a row of a device-resident block table per attention group,
written once when the request first decodes here and then only where it grew (a block id is
appended when the request gains a block). A step then gathers, in one pass over its requests,
the few numbers that change every step (input id, position, slot, each group's write block and
each recurrent group's state blocks) into one host staging buffer (pinned on CUDA), pads them to
the step's *bucket* (1, 2, 4, 8, then every 16 up to ``max_num_seqs``), and uploads them with one
non-blocking copy (on the CPU the forward reads the staging buffer itself); table growth
travels in the same copy as (flat index, block id) pairs that one ``index_copy_`` applies. On
CUDA two staging buffers take turns, so a step is prepared while the upload of the step before
may still be queued behind the device's work (``EngineCore.step`` with
``scheduler.async_scheduling``); such a step can take its input ids from the previous step's
sampled ids on the device (``run(..., previous_ids)``) instead of the host. The
forward reads only fixed device buffers, so on CUDA each bucket's forward is captured once as a
CUDA graph (all buckets in one memory pool) and replayed; on the CPU the same padded batch runs
eagerly, so CI exercises the padding. Prefill and mixed steps take the token-bucket step
(``engine.model.mixed_step``).

Padded rows decode token 0 at position 0 through the *pad slot*, whose table holds only the null
block: they write K/V and recurrent states only into the null block (id 0 of every pool, never
read for a real token) and their outputs are dropped.

Layout of the staging buffer (int64, fixed offsets so the captured graphs' addresses never move):
``ids | positions | write offsets | tiles [max, 5] | write block per attention group | state
read, state write per recurrent group | table updates (indices, then values)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_cache.block_queue import Block
from engine.model.batch import SLOT_READS, ChunkSpec, ForwardBatch, GroupIndex
from engine.model.kernels.triton_attention import PagedMeta
from engine.model.layers.recurrent import DECODE_INDEX
from engine.model.mixed_step import placeholder_id, resolve_placeholders
from engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

NULL_BLOCK = 0  # the null block's id in every pool (engine.kv_cache.block_pool takes block 0)
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STRIDE = 16
#: table entries one upload carries beyond the fixed fields, per attention group and bucket row;
#: a step with more (many requests entering decode at once) sends the rest in extra copies
UPDATES_PER_ROW = 64


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes a decode step is padded to: 1, 2, 4, 8, then multiples of 16, and
    ``max_num_seqs`` itself (every size up to it has a bucket)."""
    sizes = {b for b in SMALL_BUCKETS if b < max_num_seqs}
    sizes.update(range(BUCKET_STRIDE, max_num_seqs, BUCKET_STRIDE))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class DecodeGroups:
    """Which KV-cache groups a decode step feeds, and how: attention groups (with their sliding
    window, None for full attention) get a block-table row per slot; recurrent groups get the
    block holding each request's state and the block receiving the new one."""

    attention: tuple[int, ...]
    windows: tuple[int | None, ...]
    recurrent: tuple[int, ...]
    num_groups: int


class DecodeStep:
    """Owns the slots, the staging buffers, the device block tables and (on CUDA) the captured
    graphs of decode-only steps.

    Invariants: a request holding a slot has, in every attention group's table row of that slot,
    the block ids of its live table up to the length last sent (entries a sliding window has since
    dropped may be stale: the kernels never read out-of-window entries); the pad slot's rows are
    all the null block; graph ``b`` reads only the fixed staging and table buffers, whose
    addresses never change; a padded row writes only to null blocks.
    """

    def __init__(
        self,
        groups: DecodeGroups,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        paged: bool,
        forward: Callable[[ForwardBatch], torch.Tensor],
    ):
        """``forward``: the model (ForwardBatch -> hidden states; called under inference mode);
        ``paged``: attention reads KV through the Triton kernels' block tables (else the torch
        path's gathers)."""
        self.groups = groups
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.buckets = decode_buckets(max_num_seqs)
        self.max_bucket = self.buckets[-1]
        self.device = device
        self.paged = paged
        self.forward = forward
        self.width = -(-max_model_len // block_size)  # table entries a request can need
        self.pad_slot = max_num_seqs
        num_attention, num_recurrent = len(groups.attention), len(groups.recurrent)
        self.table_rows = max_num_seqs + 1
        self.tables = torch.zeros(
            max(num_attention, 1), self.table_rows, self.width, dtype=torch.long, device=device
        )  # one table per attention group, one row per slot (and the pad slot)
        self._tables_flat = self.tables.view(-1)
        rows = self.max_bucket
        self._ids = 0
        self._positions = rows
        self._offsets = 2 * rows
        self._tiles = 3 * rows
        self._writes = 8 * rows  # one region per attention group
        self._states = self._writes + num_attention * rows  # read then write region per recurrent group
        self.fixed = self._states + 2 * num_recurrent * rows
        self.update_capacity = rows * UPDATES_PER_ROW * max(num_attention, 1)
        size = self.fixed + 2 * self.update_capacity
        # CUDA: two pinned staging buffers taking turns; a step rewrites the one whose upload was
        # queued two steps ago, which the device has done by the time the host read that step's
        # sampled ids (the engine keeps at most one step in flight beyond the one it reads)
        turns = 2 if device.type == "cuda" else 1
        self._hosts = [torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda") for _ in range(turns)]
        self._stagings = [host.numpy() for host in self._hosts]
        self._turn = 0
        # the buffer the forward reads; on the CPU the staging buffer itself (no copy to make)
        self._device_staging = (
            self._hosts[0] if device.type == "cpu" else torch.zeros(size, dtype=torch.long, device=device)
        )
        tiles_end = self._tiles + 5 * rows
        self._tile_views = [staging[self._tiles : tiles_end].reshape(rows, 5) for staging in self._stagings]
        for tiles in self._tile_views:
            tiles[:, 1] = np.arange(rows)  # query row
            tiles[:, 3] = 1  # one query token
        self._rows = torch.arange(rows, dtype=torch.long, device=device)
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        # per slot, per attention group: the live table last sent and how many entries were sent
        self._sent_tables: list[list[list[Block] | None]] = [[None] * num_attention for _ in range(max_num_seqs)]
        self._sent_lengths: list[list[int]] = [[0] * num_attention for _ in range(max_num_seqs)]
        self._batches: dict[int, ForwardBatch] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    # -- which steps ---------------------------------------------------------------------------------
    def accepts(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether this step is decode-only: every chunk one sampled token past position 0, and no
        more chunks than the largest bucket."""
        if not chunks or len(chunks) > self.max_bucket:
            return False
        return all(c.num_tokens == 1 and c.sample and c.start > 0 for c in chunks)

    def bucket(self, count: int) -> int:
        """The smallest bucket holding ``count`` rows."""
        for size in self.buckets:
            if size >= count:
                return size
        raise ValueError(f"decode batch of {count} exceeds max_num_seqs={self.max_num_seqs}")

    # -- one step ------------------------------------------------------------------------------------
    def run(
        self,
        chunks: Sequence[ScheduledChunk],
        previous_ids: torch.Tensor | None = None,
        previous_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """The hidden states of ``chunks`` (``accepts`` must hold), one row per chunk in order.

        ``previous_ids``: the sampled ids (on the device) of the step before; where
        ``previous_rows[i]`` is not negative, chunk ``i``'s input token is that row of them, not
        yet known on the host (a placeholder the scheduler counted,
        ``Scheduler.schedule_continuation``): the row travels in the upload where the id would
        (``placeholder_id``), and the device reads the id (``resolve_placeholders``); a
        negative entry: the id is known. A failed row's -1 is read as token 0 (its request
        fails and this row's output is dropped)."""
        count = len(chunks)
        size = self.bucket(count)
        self._prepare(chunks, size, previous_rows if previous_ids is not None else None)
        if previous_ids is not None:
            resolve_placeholders(self._device_staging[self._ids : self._ids + count], previous_ids)
        graph = self._graphs.get(size)
        if graph is not None:
            graph[0].replay()
            return graph[1][:count]
        batch = self._batch(size)
        if not self.paged:  # the torch path's gathers follow this step's positions
            for index in batch.groups:
                index.derived.pop(SLOT_READS, None)
        return self.forward(batch)[:count]

    def release(self, request_id: str) -> None:
        """Forget ``request_id``'s slot (it finished or was aborted); unknown ids are ignored."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._forget_slot(slot)

    @property
    def num_slots_held(self) -> int:
        return len(self._slot_of)

    def _forget_slot(self, slot: int) -> None:
        self._sent_tables[slot] = [None] * len(self.groups.attention)
        self._free_slots.append(slot)

    def _claim_slot(self, request_id: str, scheduled: Sequence[ScheduledChunk]) -> int:
        if not self._free_slots:  # slots of requests not in this step (preempted, or never released)
            present = {c.request.request_id for c in scheduled}
            for rid in [rid for rid in self._slot_of if rid not in present]:
                self._forget_slot(self._slot_of.pop(rid))
        slot = self._free_slots.pop()
        self._slot_of[request_id] = slot
        return slot

    def _prepare(self, chunks: Sequence[ScheduledChunk], size: int, input_rows: Sequence[int] | None = None) -> None:
        """Gather the step's inputs into the staging buffer, upload it, apply table growth
        (``input_rows``: where one is not negative, stage that row of the previous step's ids
        instead of the id, as ``placeholder_id``)."""
        self._turn = (self._turn + 1) % len(self._hosts)
        bs, width = self.block_size, self.width
        attention, recurrent = self.groups.attention, self.groups.recurrent
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        writes: list[list[int]] = [[] for _ in attention]
        states: list[list[int]] = [[] for _ in range(2 * len(recurrent))]
        update_index: list[int] = []
        update_value: list[int] = []
        slot_of, sent_tables, sent_lengths = self._slot_of, self._sent_tables, self._sent_lengths
        row_stride = self.table_rows * width
        for i, chunk in enumerate(chunks):
            request = chunk.request
            pos = chunk.start
            if input_rows is None or input_rows[i] < 0:
                ids.append(request.token_ids[pos])
            else:
                ids.append(placeholder_id(input_rows[i]))
            positions.append(pos)
            slot = slot_of.get(request.request_id)
            if slot is None:
                slot = self._claim_slot(request.request_id, chunks)
            slots.append(slot)
            tables = chunk.tables
            sent, lengths = sent_tables[slot], sent_lengths[slot]
            block = pos // bs
            for a, g in enumerate(attention):
                table = tables[g]
                length = len(table)
                if table is not sent[a]:  # first decode here, or re-admitted: the whole row
                    sent[a], first = table, 0
                else:
                    first = lengths[a]
                if first != length:
                    base = a * row_stride + slot * width
                    update_index.extend(range(base + first, base + length))
                    update_value.extend([b.block_id for b in table[first:]])
                    lengths[a] = length
                writes[a].append(table[block].block_id)
            for r, g in enumerate(recurrent):
                table = tables[g]
                states[2 * r].append(table[(pos - 1) // bs].block_id)
                states[2 * r + 1].append(table[block].block_id)
        count = len(chunks)
        padded = count < size
        staging = self._stagings[self._turn]
        staging[self._ids : self._ids + count] = ids
        staging[self._positions : self._positions + count] = positions
        tiles = self._tile_views[self._turn]
        tiles[:count, 0] = slots
        tiles[:count, 2] = positions
        if padded:  # padded rows: token 0 at position 0 in the pad slot, null blocks only
            staging[self._ids + count : self._ids + size] = 0
            staging[self._positions + count : self._positions + size] = 0
            tiles[count:size, 0] = self.pad_slot
            tiles[count:size, 2] = 0
        offsets = staging[self._offsets : self._offsets + size]
        np.remainder(staging[self._positions : self._positions + size], bs, out=offsets)
        rows = self.max_bucket
        for a, column in enumerate(writes):
            lo = self._writes + a * rows
            staging[lo : lo + count] = column
            if padded:
                staging[lo + count : lo + size] = NULL_BLOCK
        for r, column in enumerate(states):
            lo = self._states + r * rows
            staging[lo : lo + count] = column
            if padded:
                staging[lo + count : lo + size] = NULL_BLOCK
        self._upload(update_index, update_value)

    def _upload(self, index: list[int], value: list[int]) -> None:
        """One copy of the fixed fields and the table updates; updates beyond the capacity go
        first, in blocking copies (the host buffer is reused at once)."""
        capacity, fixed = self.update_capacity, self.fixed
        staging, host, device = self._stagings[self._turn], self._hosts[self._turn], self._device_staging
        while len(index) > capacity:
            head_index, index = index[:capacity], index[capacity:]
            head_value, value = value[:capacity], value[capacity:]
            staging[fixed : fixed + capacity] = head_index
            staging[fixed + capacity : fixed + 2 * capacity] = head_value
            if device is not host:
                device[fixed : fixed + 2 * capacity].copy_(host[fixed : fixed + 2 * capacity])
            self._tables_flat.index_copy_(
                0, device[fixed : fixed + capacity], device[fixed + capacity : fixed + 2 * capacity]
            )
        count = len(index)
        end = fixed + 2 * count
        if count:
            staging[fixed : fixed + count] = index
            staging[fixed + count : end] = value
        if device is not host:
            device[:end].copy_(host[:end], non_blocking=True)
        if count:
            self._tables_flat.index_copy_(0, device[fixed : fixed + count], device[fixed + count : end])

    # -- the static batch ----------------------------------------------------------------------------
    def _batch(self, size: int) -> ForwardBatch:
        """The ForwardBatch of bucket ``size``: views of the fixed device buffers (built once)."""
        batch = self._batches.get(size)
        if batch is not None:
            return batch
        staging, rows = self._device_staging, self.max_bucket
        offsets = staging[self._offsets : self._offsets + size]
        tiles = staging[self._tiles : self._tiles + 5 * rows].view(rows, 5)[:size]
        indices: list[GroupIndex] = [GroupIndex(self._rows[:0], self._rows[:0]) for _ in range(self.groups.num_groups)]
        for a, g in enumerate(self.groups.attention):
            lo = self._writes + a * rows
            index = GroupIndex(staging[lo : lo + size], offsets)
            window = self.groups.windows[a]
            if self.paged:
                index.paged = PagedMeta(tiles, tiles, self.tables[a], size, 1, window)
            else:
                index.slots, index.slot_tables, index.window = tiles[:, 0], self.tables[a], window
            indices[g] = index
        for r, g in enumerate(self.groups.recurrent):
            read = self._states + 2 * r * rows
            write = read + rows
            index = indices[g]
            index.derived[DECODE_INDEX] = (
                self._rows[:size],
                staging[read : read + size],
                None,
                staging[write : write + size],
            )
        batch = ForwardBatch(
            input_ids=staging[self._ids : self._ids + size],
            positions=staging[self._positions : self._positions + size],
            chunks=[ChunkSpec(i, 0, 1) for i in range(size)],  # starts unread: positions hold them
            prefill_chunks=[],
            decode_chunks=list(range(size)),
            groups=indices,
            sample_indices=self._rows[:size],
        )
        self._batches[size] = batch
        return batch

    # -- CUDA graphs ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's forward (largest first, one memory pool), from all-padded
        inputs: only null blocks are written. Records ``capture_seconds`` and ``capture_bytes``."""
        if self.device.type != "cuda":
            raise RuntimeError("DecodeStep.capture needs a CUDA device")
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as torch.cuda.graph does on entry: the difference is the graphs'
        started, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        self._prepare([], self.max_bucket)
        for size in reversed(self.buckets):
            batch = self._batch(size)
            for _ in range(2):  # compile kernels and create library handles outside the capture
                self.forward(batch)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.forward(batch)
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info(
            "captured %d decode graphs (batch 1..%d) in %.2f s, %.1f MiB",
            len(self._graphs),
            self.max_bucket,
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    def drop_graphs(self) -> None:
        """Forget every captured graph (after a failed capture, or at close): steps then run the
        forward eagerly."""
        if not self._graphs:
            return
        self._graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)
