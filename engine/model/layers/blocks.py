"""Building blocks: RMSNorm (Llama and Gemma styles), rotary embedding, activations, gated MLP, the
output projection and linear fusion. Attention lives in ``engine.model.layers.attention``.

Module names match Hugging Face checkpoints (``gate_proj``, ``input_layernorm`` ...) so weights
load by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch.model_arch import RopeArch
from engine.model.kernels import triton_act, triton_norm
from engine.model.layers.parallel import all_reduce


class RMSNorm(nn.Module):
    """RMS normalisation in fp32; Gemma scales by ``1 + weight`` (zero-initialised weights).

    ``forward(x, residual)`` returns ``residual + norm(x)`` when a residual is given (the
    decoder's post-norm adds); ``then`` and ``add`` join a residual add and the next norm, and
    ``enter`` sums a layer's ``PendingResidual`` into the hidden state as it normalises it. Where
    ``triton_norm.enabled`` (CUDA) the norm, its casts and the add (and the next norm) are one
    Triton kernel; elsewhere one fused ``F.rms_norm`` between two casts (a norm is 9
    small ops written out). Gemma's ``1 + weight`` is kept between calls and rebuilt when the
    weight changes (its storage or ``_version``)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self._gemma_scale: tuple[tuple[int, int], torch.Tensor] | None = None  # (weight storage+version, 1 + w)
        self._kernel: bool | None = None  # triton_norm.enabled for the weight's device, read at first use

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self._kernel is None:
            self._kernel = triton_norm.enabled(self.weight.device)
        if self._kernel:
            return triton_norm.rms_norm(x, self.weight_for_kernel(), self.eps, self.gemma, residual)
        dtype, shape = x.dtype, (x.shape[-1],)
        if self.gemma:
            out = F.rms_norm(x.float(), shape, self._scale(), self.eps).to(dtype)
        else:
            out = self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(dtype)
        return out if residual is None else residual + out

    def then(self, x: torch.Tensor, residual: torch.Tensor, after: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = self(x, residual)`` and ``after(s)``: one launch where the kernel runs (a post-norm
        with its residual, then the next pre-norm: Gemma3), else the two calls."""
        if self._kernel is None:
            self._kernel = triton_norm.enabled(self.weight.device)
        if self._kernel and self.gemma == after.gemma:
            return triton_norm.norm_add_norm(
                x, residual, self.weight_for_kernel(), after.weight_for_kernel(), self.eps, self.gemma
            )
        out = self(x, residual)
        return out, after(out)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = residual + x`` and ``self(s)``: one launch where the kernel runs (a pre-norm
        decoder's residual add and its next norm), else the add and the norm."""
        if self._kernel is None:
            self._kernel = triton_norm.enabled(self.weight.device)
        if self._kernel:
            return triton_norm.add_norm(x, residual, self.weight_for_kernel(), self.eps, self.gemma)
        total = residual + x
        return total, self(total)

    def enter(self, x: torch.Tensor, pending: PendingResidual | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state ``x`` with the previous layer's ``pending`` add summed in, and that
        state normalised by this norm: one launch where the kernel runs (``add``, or ``then``
        when the pending delta has a post-norm of its own), else the same ops one by one."""
        if pending is None:
            return x, self(x)
        if pending.post_norm is None:
            return self.add(pending.delta, x)
        return pending.post_norm.then(pending.delta, x, self)

    def weight_for_kernel(self) -> torch.Tensor:
        """What the Triton kernels take as this norm's weight: Gemma's fp32 ``1 + weight``, else
        the weight itself."""
        return self._scale() if self.gemma else self.weight

    def _scale(self) -> torch.Tensor:
        """``1 + weight`` in fp32, rebuilt when the weight is written or replaced."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._gemma_scale is None or self._gemma_scale[0] != key:
            with torch.no_grad():
                self._gemma_scale = (key, 1.0 + self.weight.float())
        return self._gemma_scale[1]


class PendingResidual(NamedTuple):
    """The residual add a layer leaves to the next norm (``RMSNorm.enter``: the next layer's input
    norm, or the stack's final norm), so the add and that norm are one launch: the hidden state
    is ``x + delta``, or ``x + post_norm(delta)`` where the layer ends in a post-norm (Gemma3's
    post-feed-forward norm)."""

    delta: torch.Tensor
    post_norm: RMSNorm | None = None


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention) for one layer type."""

    inv_freq: torch.Tensor  # a buffer (``register_buffer`` in ``__init__``)

    def __init__(self, rope: RopeArch, head_dim: int):
        super().__init__()
        inv_freq = torch.tensor(rope.inv_freq(head_dim), dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = rope.rotary_dim or head_dim
        self.attention_factor = rope.attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for ``positions``, ``[T, rotary_dim]``: the sin's first half is
        negated here, once per step, so ``apply`` needs no negation per layer."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # not nn.Module.apply(fn): the rotation
        """``x``: [T, heads, head_dim]; ``cos``/``sin``: ``cos_sin``'s [T, rotary_dim]. The
        rotate-half convention ``x * cos + cat(-x2, x1) * sin`` as ``x * cos + cat(x2, x1) * sin'``
        with ``sin' = cat(-sin, sin)`` (the same products, bit for bit)."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        swapped = rot.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # cat(x2, x1)
        out = rot * cos[:, None, :] + swapped * sin[:, None, :]
        return torch.cat((out, rest), dim=-1) if rest.numel() else out


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config's ``hidden_act`` names; an unknown name is an error naming it."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act: {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def lm_head(hidden_size: int, vocab_size: int, embedding: nn.Embedding, tied: bool) -> nn.Linear:
    """The output projection (no bias); with ``tied`` it shares ``embedding``'s weight."""
    head = nn.Linear(hidden_size, vocab_size, bias=False)
    if tied:
        head.weight = embedding.weight
    return head


def fuse_linears(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``linears``' output rows back to back, so one matmul computes
    them all; each linear's parameters become views of it, so checkpoint names, ``state_dict`` and
    ``load_state_dict`` still address them (and a load writes through to the fused tensor)."""
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        has_bias = all(linear.bias is not None for linear in linears)
        bias = torch.cat([linear.bias for linear in linears]) if has_bias else None
        start = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
    return weight, bias


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; after ``fuse_projections`` gate and up are one matmul, and
    where ``triton_act.enabled`` the activation and the product one kernel.
    ``reduce``: this rank holds a column slice of gate/up and a row slice of down (tensor
    parallelism, engine/model/layers/parallel.py), so the output is summed over the ranks."""

    def __init__(self, hidden: int, intermediate: int, act: str, reduce: bool = False):
        super().__init__()
        self.reduce = reduce
        activation(act)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _ACTIVATIONS[act]
        self.act_name = act
        self._gate_up: torch.Tensor | None = None  # fused gate + up weight (fuse_projections)
        self._kernel: bool | None = None  # triton_act.enabled for the weights' device, read at first use

    def fuse_projections(self) -> None:
        """Concatenate the gate and up weights once, after the checkpoint is loaded."""
        self._gate_up, _ = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            out = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        else:
            if self._kernel is None:
                self._kernel = triton_act.enabled(self._gate_up.device)
            gate_up = F.linear(x, self._gate_up)
            if self._kernel:  # the activation and the product: one launch
                out = self.down_proj(triton_act.act_mul(gate_up, self.act_name))
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                out = self.down_proj(self.act(gate) * up)
        return all_reduce(out) if self.reduce else out
