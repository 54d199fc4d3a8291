"""Small host-built tensors (a step's indices, block ids, sampling parameters) copied to the device
without waiting for the work already queued there.

On CUDA a copy from pageable host memory makes the host wait until the stream has run everything
queued before it. A step launched while the one before still runs
(``scheduler.async_scheduling``) would then wait for it, and so would a piecewise-replayed
mixed step, whose mixers build their indices between graph pieces (engine/model/mixed_step.py).
Through pinned memory the copy is queued non-blocking instead; torch's caching host allocator
keeps the pinned block until the copy has run, so the host tensor may be dropped at once. It must
not be written after the call. Off CUDA nothing is queued: the tensor is returned (CPU) or copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor made for this copy, never written after it) on ``device``, queued
    behind the device's work without waiting for it."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host if host.device == device else host.to(device)


def to_device(values: Sequence[object], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on ``device`` (``upload``)."""
    return upload(torch.tensor(values, dtype=dtype), device)
