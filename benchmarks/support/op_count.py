"""The device operations one decode step of the model dispatches, counted without a GPU.

``DispatchCounter`` is a ``TorchDispatchMode``: every aten operator that reaches the dispatcher
while it is active is seen once. Views and metadata (``OpOverload.is_view``: reshape, transpose,
slicing; ``detach``, ``alias``), allocations that launch nothing (``empty``, ``empty_strided``,
``empty_like``) and the host read of a scalar (``_local_scalar_dense``) are left out; every other
operator counts one, which on CUDA is one kernel (a few aten operators launch two, a fused Triton
kernel or a compiled region launches one and dispatches nothing: the count is a proxy that the GPU
run checks against the profiler's ``kernels_per_step``).

``decode_ops(engine)`` counts what one decode ``step()`` dispatches inside the model's
``forward`` and ``logits`` (the engine's model compute; the scheduler, batch build and sampler are
host work around it), on the engine's own path for its device.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core import EngineCore
from engine.sampling_params import SamplingParams

_NOT_KERNELS = {
    "aten::detach",
    "aten::detach_",
    "aten::alias",
    "aten::lift_fresh",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::_local_scalar_dense",
    "aten::sym_size",
    "aten::sym_stride",
    "aten::sym_numel",
    "aten::sym_storage_offset",
}


def is_device_op(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` launches device work (not a view, metadata or a bare allocation)."""
    return not func.is_view and func._schema.name not in _NOT_KERNELS


class DispatchCounter(TorchDispatchMode):
    """Owns the count of device operations dispatched while it is on (``active``), by operator.
    Invariant: ``total`` is the sum of ``by_op``."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.by_op: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.active and is_device_op(func):
            self.by_op[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def _counting(counter: DispatchCounter, inner: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.active = True
        try:
            return inner(*args, **kwargs)
        finally:
            counter.active = False

    return counted


def decode_ops(engine: EngineCore, vocab: int, batch: int = 1, prompt_len: int = 32) -> dict[str, Any]:
    """``batch`` requests of ``prompt_len`` tokens are prefilled and decoded twice (uncounted),
    then one decode step is counted: ``{"ops": n, "by_op": {name: n, ...}}``."""
    prompts = [[(7 * r + 3 * i) % (vocab - 1) + 1 for i in range(prompt_len)] for r in range(batch)]
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for r, prompt in enumerate(prompts):
        engine.add_request(f"ops-{r}", prompt, sampling)
    for _ in range(3):  # the prefill, then decodes (a first decode may still set things up)
        engine.step()
    model = engine.runner.model
    counter = DispatchCounter()
    originals = {name: getattr(model, name) for name in ("forward", "logits")}
    own = {name for name in originals if name in vars(model)}  # already set on the instance
    for name, inner in originals.items():
        setattr(model, name, _counting(counter, inner))
    try:
        with counter:
            engine.step()
    finally:
        for name, inner in originals.items():
            if name in own:
                setattr(model, name, inner)
            else:
                delattr(model, name)  # the class's method shows again
    for r in range(batch):
        engine.abort(f"ops-{r}")
    return {"ops": counter.total, "by_op": dict(counter.by_op.most_common())}
