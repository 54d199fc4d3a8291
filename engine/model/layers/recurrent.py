"""The interface every recurrent-state layer (Mamba2, Gated DeltaNet) implements for the runner.

A recurrent layer keeps one fp32 state per request (for example a causal-conv window plus an SSM
or delta-rule state) in the state blocks of its KV-cache group. The runner hands it a flat fp32
view of its slot, ``[num_blocks, floats_per_block]``, once; the layer carves its own typed views.
During a forward, chunk ``i`` of the batch reads the state in block ``index.state_read[i]`` (or
starts from zeros when that is ``-1``) and writes the state after the chunk into
``index.state_write[i]`` (see ``engine.model.batch.build_state_index``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from engine.model.batch import ForwardBatch, GroupIndex
from engine.model.layers.attention import Attention
from engine.model.uploads import to_device

#: the ``GroupIndex.derived`` key of a recurrent group's decode index (``decode_index``); a static
#: decode batch (``engine.model.decode_step``) sets it once to its fixed device buffers
DECODE_INDEX = "recurrent_decode"


class RecurrentMixer(nn.Module, ABC):
    """A layer whose cache is one fixed-size state per request, not per-token KV.

    Owns: the views of its state blocks (set by ``bind_state``). Invariant: ``state_floats`` is
    the exact number of fp32 values one request's state needs; a block's first ``state_floats``
    values are the whole state and nothing else writes them.
    """

    group: int

    @property
    @abstractmethod
    def state_floats(self) -> int:
        """The fp32 values one request's state takes."""

    @abstractmethod
    def bind_state(self, states: torch.Tensor) -> None:
        """Take ``states``, an fp32 ``[num_blocks, >= state_floats]`` view, as this layer's state memory."""


def cache_users(layer: nn.Module) -> list[Attention | RecurrentMixer]:
    """The modules of one decoder layer that read or write the KV cache (attention or recurrent
    mixers); empty for layers without a cache (an MLP-only layer)."""
    return [m for m in layer.modules() if isinstance(m, (Attention, RecurrentMixer))]


def read_blocks(reads: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block ids to gather for ``reads`` (-1 mapped to block 0) and the mask of fresh chunks (those
    starting from zeros; None when there are none)."""
    source = to_device([max(r, 0) for r in reads], device, torch.long)
    fresh = to_device([r < 0 for r in reads], device) if min(reads) < 0 else None
    return source, fresh


def write_blocks(writes: list[int], device: torch.device) -> torch.Tensor:
    """Block ids receiving the chunks' new states."""
    return to_device(writes, device, torch.long)


def decode_index(batch: ForwardBatch, index: GroupIndex, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The decode chunks' flat rows, state blocks to read, fresh mask (or None) and blocks to
    write, as device tensors: built by the group's first recurrent layer of the step and shared by
    the others (every recurrent kind reads the same four)."""

    def build() -> tuple[torch.Tensor | None, ...]:
        order = batch.decode_chunks
        rows = to_device([batch.chunks[i].offset for i in order], device, torch.long)
        source, fresh = read_blocks([index.state_read[i] for i in order], device)
        target = write_blocks([index.state_write[i] for i in order], device)
        return rows, source, fresh, target

    return index.shared(DECODE_INDEX, build)
