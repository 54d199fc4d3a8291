"""The language model every family fills in: token embedding -> layers -> final norm gives the
step's hidden states; ``logits`` projects only the rows to sample.

A family supplies its layer stack (its layers under the checkpoint's weight names) and overrides
``embed`` or ``logits`` only where its scaling differs (Gemma3's embedding scale and logit
softcap, Granite's multipliers). ``engine.model.checkpoints.loader`` builds one per
``ModelArch.family``; the runner binds caches through ``model.layers``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Protocol, cast

import torch
from torch import nn

from engine.model.arch.model_arch import ModelArch
from engine.model.batch import ForwardBatch
from engine.model.layers.blocks import PendingResidual, RMSNorm, lm_head
from engine.model.layers.parallel import gather_vocab, token_embedding

#: the step's rotary cos/sin per rotary type (``Attention.step_rope``), shared by all layers
RopeMemo = dict[object, tuple[torch.Tensor, torch.Tensor]]


class LayerStack(Protocol):
    """What ``LanguageModel`` reads of a family's body, an ``nn.Module`` whose own attribute names
    follow the checkpoint: each layer is called as ``layer(x, pending, batch, ropes)`` and returns
    ``(x, pending)``: the hidden states and the residual add it leaves to the next norm
    (``PendingResidual``; the state is ``x`` plus it). The first layer gets ``pending`` None."""

    @property
    def embed_tokens(self) -> nn.Embedding: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def norm(self) -> RMSNorm: ...


class DecoderStack(nn.Module):
    """Owns the token embedding, the layers and the final RMS norm under Hugging Face's ``model.*``
    names (``embed_tokens``, ``layers.{i}``, ``norm``). Invariant: the norm is Gemma-style
    (``1 + weight``) exactly when ``gemma_norm``."""

    def __init__(self, arch: ModelArch, layers: Iterable[nn.Module], gemma_norm: bool = False):
        super().__init__()
        self.embed_tokens = token_embedding(arch)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, gemma_norm)


class LanguageModel(nn.Module):
    """Owns one family's layer stack (registered as ``STACK_NAME``, the prefix of its checkpoint
    names) and ``lm_head`` (tied to the embedding with ``arch.tie_word_embeddings``).

    ``forward(batch)`` returns the hidden states of every token of the step; ``logits(rows)`` the
    fp32 logits of the rows to sample (prefill never projects every position). Invariant: each
    rotary type (or none) is computed once per step and shared by its layers (``RopeMemo``), and
    each layer's last residual add is summed by the next norm (``PendingResidual``).
    """

    #: the layer stack's attribute name: the prefix of its weights in the checkpoint
    STACK_NAME: ClassVar[str] = "model"
    #: checkpoint tensor prefixes the loader drops (weights the model does not use)
    IGNORED_WEIGHT_PREFIXES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, arch: ModelArch, stack: LayerStack):
        super().__init__()
        assert isinstance(stack, nn.Module), "a layer stack is an nn.Module"
        self.arch = arch
        self.add_module(self.STACK_NAME, stack)
        self.lm_head = lm_head(
            arch.hidden_size, arch.vocab_size // arch.tp_size, stack.embed_tokens, arch.tie_word_embeddings
        )

    @property
    def model(self) -> LayerStack:
        """The layer stack, whatever ``STACK_NAME`` the checkpoint gives it (an AttributeError
        before ``__init__`` registers it, as for any missing submodule)."""
        try:
            return cast(LayerStack, self._modules[self.STACK_NAME])
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no layer stack {self.STACK_NAME!r} yet") from None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's input hidden states: the token embeddings (families scale them here)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        stack = self.model
        x = self.embed(batch.input_ids)
        ropes: RopeMemo = {}
        pending: PendingResidual | None = None
        for layer in stack.layers:
            x, pending = layer(x, pending, batch, ropes)
        return stack.norm.enter(x, pending)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of ``hidden``'s rows (every rank's vocabulary slice joined, under tensor
        parallelism)."""
        logits = self.lm_head(hidden).float()
        return gather_vocab(logits) if self.arch.tp_size > 1 else logits
