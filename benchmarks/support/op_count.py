"""The device operations one decode step of the model dispatches, counted without a GPU.

``DispatchCounter`` is a ``TorchDispatchMode``: every aten operator that reaches the dispatcher
while it is active is seen once. Views and metadata (``OpOverload.is_view``: reshape, transpose,
slicing; ``detach``, ``alias``), allocations that launch nothing (``empty``, ``empty_strided``,
``empty_like``) and the host read of a scalar (``_local_scalar_dense``) are left out; every other
operator counts one, which on CUDA is one kernel (a few aten operators launch two, a fused Triton
kernel or a compiled region launches one and dispatches nothing: the count is a proxy that the GPU
run checks against the profiler's ``kernels_per_step``).

A Triton launch does not reach the dispatcher: ``DispatchCounter`` wraps triton's launch entry
points (``JITFunction.run``, and ``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``) while
it is on, so each launch counts one (``triton::<kernel>``) and the torch operators the launch
itself runs (the interpreter's argument copies, the kernel's host-side setup) count nothing.

``decode_ops(engine)`` counts what one decode ``step()`` dispatches inside the model's
``forward`` and ``logits`` (the engine's model compute; the scheduler, batch build and sampler are
host work around it), on the engine's own path for its device. ``fused_path()`` is the
environment that puts an engine built inside it on the Triton path of every kernel
(``KVFLEET_ATTENTION``, ``KVFLEET_NORM``, ``KVFLEET_ROPE``, ``KVFLEET_ACT``,
``KVFLEET_MAMBA_KERNEL`` = triton;
engine/model/kernels/), the CPU running the kernels under Triton's interpreter.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def count_triton_launches(counter: DispatchCounter) -> Iterator[None]:
    """While on, each Triton launch counts one in ``counter`` (when it is active), named by its
    kernel; what the launch dispatches to torch itself is not counted."""
    try:
        from triton.runtime import interpreter, jit
    except ImportError:  # no triton: no launch to count
        yield
        return
    classes = (jit.JITFunction, interpreter.InterpretedFunction)
    originals = {cls: cls.run for cls in classes}

    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if not counter.active:
                return run(fn, *args, **kwargs)
            counter.by_op[f"triton::{getattr(fn, '__name__', 'kernel')}"] += 1
            counter.active = False
            try:
                return run(fn, *args, **kwargs)
            finally:
                counter.active = True

        return counted

    for cls, run in originals.items():
        cls.run = wrap(run)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run  # type: ignore[method-assign]


#: the kernel choices ``fused_path`` sets (engine/model/kernels/: ``kernel_choice``)
KERNEL_VARIABLES = ("KVFLEET_ATTENTION", "KVFLEET_NORM", "KVFLEET_ROPE", "KVFLEET_ACT", "KVFLEET_MAMBA_KERNEL")


@contextlib.contextmanager
def fused_path(device: str) -> Iterator[None]:
    """Every kernel choice set to triton while an engine is built and run inside; on a CPU the
    kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, which triton reads when its
    language module is first imported: set it before anything imports triton)."""
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("fused_path on a CPU needs TRITON_INTERPRET=1 set before triton is imported")
    saved = {name: os.environ.get(name) for name in KERNEL_VARIABLES}
    os.environ.update(dict.fromkeys(KERNEL_VARIABLES, "triton"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
        with counter, count_triton_launches(counter):
            engine.step()
    finally:
        for name, inner in originals.items():
            if name in own:
                setattr(model, name, inner)
            else:
                delattr(model, name)  # the class's method shows again
    for r in range(batch):
        engine.abort(f"ops-{r}")
    if not counter.total:
        raise RuntimeError("decode_ops: the counted step ran nothing (did the engine's step fail? see its log)")
    return {"ops": counter.total, "by_op": dict(counter.by_op.most_common())}
