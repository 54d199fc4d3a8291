"""The interface every recurrent-state layer (Mamba2, Gated DeltaNet) implements for the runner.

A recurrent layer keeps one fp32 state per request (for example a causal-conv window plus an SSM
or delta-rule state) in the state blocks of its KV-cache group. The runner hands it a flat fp32
view of its slot, ``[num_blocks, floats_per_block]``, once; the layer carves its own typed views.
During a forward, chunk ``i`` of the batch reads the state in block ``index.state_read[i]`` (or
starts from zeros when that is ``-1``) and writes the state after the chunk into
``index.state_write[i]`` (see ``engine.model.batch.build_state_index``).
"""

from __future__ import annotations

import torch
from torch import nn


class RecurrentMixer(nn.Module):
    """A layer whose cache is one fixed-size state per request, not per-token KV.

    Owns: the views of its state blocks (set by ``bind_state``). Invariant: ``state_floats`` is
    the exact number of fp32 values one request's state needs; a block's first ``state_floats``
    values are the whole state and nothing else writes them.
    """

    group: int

    @property
    def state_floats(self) -> int:
        raise NotImplementedError

    def bind_state(self, states: torch.Tensor) -> None:
        """Take ``states``, an fp32 ``[num_blocks, >= state_floats]`` view, as this layer's state memory."""
        raise NotImplementedError


def cache_users(layer: nn.Module) -> list[nn.Module]:
    """The modules of one decoder layer that read or write the KV cache (attention or recurrent
    mixers); empty for layers without a cache (an MLP-only layer)."""
    from engine.model.decoder import Attention

    return [m for m in layer.modules() if isinstance(m, (Attention, RecurrentMixer))]
