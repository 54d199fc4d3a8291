"""ForwardBatch: one step's flattened tokens and, per KV-cache group, where their KV lives.

Built once per step by the runner and passed to every layer; layers never look at the
coordinator. Attention layers of one group share that group's index tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model.kernels.triton_attention import PagedMeta, build_paged_meta
from engine.model.uploads import upload


@dataclass(frozen=True)
class ChunkSpec:
    """One request's slice of the step: ``num_tokens`` tokens from position ``start``."""

    offset: int  # index of its first token in the flattened batch
    start: int
    num_tokens: int


@dataclass
class GroupIndex:
    """Per-group gather/scatter indices (block id, offset in block) for one step.

    ``write_*``: where each new token's KV goes. For each prefill chunk, ``read_*`` covers key
    positions ``[lo, start + n)``; decode chunks (one token) are padded into ``[B, S]`` tensors with
    ``decode_valid`` marking real keys. With ``paged`` (the Triton path) the kernels read KV in
    place through its block tables, and ``prefill_reads``/``decode_*`` stay empty.
    """

    write_block: torch.Tensor
    write_offset: torch.Tensor
    prefill_reads: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    decode_block: torch.Tensor | None = None
    decode_offset: torch.Tensor | None = None
    decode_valid: torch.Tensor | None = None
    state_read: list[int] = field(default_factory=list)  # Mamba: block holding the state at start (-1: none)
    state_write: list[int] = field(default_factory=list)  # Mamba: block receiving the state at the end
    paged: PagedMeta | None = None  # Triton path: tiles and block tables (engine/model/kernels/triton_attention.py)
    # a static decode batch on the torch path (engine/model/decode_step.py): each row's slot in
    # ``slot_tables`` ([slots, width] block ids) and the group's window; the attention layer
    # derives its key gathers from them (``slot_table_reads``), as the Triton kernel reads them
    slots: torch.Tensor | None = None
    slot_tables: torch.Tensor | None = None
    window: int | None = None
    # values derived from the fields above (device tensors, the Mamba kernel choice), built by the
    # group's first layer that needs them and shared by the others: one host-to-device copy (or
    # environment read) per step per group, not per layer
    derived: dict[str, Any] = field(default_factory=dict)

    def shared(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()`` once per step for this group; later layers get the same value."""
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]


@dataclass
class ForwardBatch:
    """Flattened input of one step. ``decode_chunks`` / ``prefill_chunks`` index into ``chunks``."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    chunks: list[ChunkSpec]
    prefill_chunks: list[int]
    decode_chunks: list[int]
    groups: list[GroupIndex]
    sample_indices: torch.Tensor
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # reused K/V gather buffers (flat)


def build_group_index(
    chunks: list[ChunkSpec],
    tables: list[list[int]],
    block_size: int,
    window: int | None,
    prefill_chunks: list[int],
    decode_chunks: list[int],
    device: torch.device,
    paged: bool = False,
) -> GroupIndex:
    """Index tensors for one group; ``tables[i]`` is chunk i's block table in this group. With
    ``paged`` only the writes and the Triton path's ``PagedMeta`` are built."""
    table_tensors = [torch.tensor(table, dtype=torch.long) for table in tables]
    writes = [torch.arange(chunk.start, chunk.start + chunk.num_tokens) for chunk in chunks]
    write_block = torch.cat([t[pos // block_size] for t, pos in zip(table_tensors, writes, strict=True)])
    write_offset = torch.cat([pos % block_size for pos in writes])
    index = GroupIndex(upload(write_block, device), upload(write_offset, device))
    if paged:
        index.paged = build_paged_meta(chunks, tables, block_size, window, device)
        return index
    for c in prefill_chunks:
        chunk, table = chunks[c], table_tensors[c]
        end = chunk.start + chunk.num_tokens
        lo = max(0, chunk.start - window + 1) if window else 0
        key_pos = torch.arange(lo, end)
        query_pos = torch.arange(chunk.start, end)
        allowed = key_pos[None, :] <= query_pos[:, None]
        if window:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        index.prefill_reads.append(
            (
                c,
                upload(table[key_pos // block_size], device),
                upload(key_pos % block_size, device),
                upload(allowed, device),
            )
        )
    if decode_chunks:
        ends = torch.tensor([chunks[c].start + 1 for c in decode_chunks])
        los = (ends - window).clamp(min=0) if window else torch.zeros_like(ends)
        width = int((ends - los).max())
        pos = los[:, None] + torch.arange(width)[None, :]
        valid = pos < ends[:, None]
        pos = torch.where(valid, pos, los[:, None])
        blocks = torch.stack([table_tensors[c][row // block_size] for c, row in zip(decode_chunks, pos, strict=True)])
        index.decode_block = upload(blocks, device)
        index.decode_offset = upload(pos % block_size, device)
        index.decode_valid = upload(valid, device)
    return index


def build_state_index(chunks: list[ChunkSpec], tables: list[list[int]], block_size: int) -> GroupIndex:
    """Mamba group: per chunk, the block with the state after ``start`` tokens (the one at index
    ``(start - 1) // block_size``) and the block that receives the state after the chunk."""
    empty = torch.empty(0, dtype=torch.long)
    index = GroupIndex(empty, empty)
    for chunk, table in zip(chunks, tables, strict=True):
        index.state_read.append(table[(chunk.start - 1) // block_size] if chunk.start else -1)
        index.state_write.append(table[(chunk.start + chunk.num_tokens - 1) // block_size])
    return index


SLOT_READS = "slot_reads"  # GroupIndex.derived key of ``slot_table_reads``' result


def slot_table_reads(
    index: GroupIndex, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode rows' padded key gathers (blocks, offsets, valid: ``[B, S]``, the shape of
    ``decode_block`` / ``decode_offset`` / ``decode_valid``) from ``index.slot_tables``: array
    operations over all rows, built once per step per group and shared by its layers."""

    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert index.slots is not None and index.slot_tables is not None
        ends = positions + 1
        window = index.window
        longest = int(ends.max())
        lows = (ends - window).clamp(min=0) if window else torch.zeros_like(ends)
        width = min(longest, window) if window else longest
        keys = lows[:, None] + torch.arange(width, device=positions.device)[None, :]
        valid = keys < ends[:, None]
        keys = torch.where(valid, keys, lows[:, None])
        blocks = index.slot_tables.index_select(0, index.slots).gather(1, keys // block_size)
        return blocks, keys % block_size, valid

    return index.shared(SLOT_READS, build)
