"""Shared layout and helpers for the transfer tests: three slot tensors with different page sizes."""

from __future__ import annotations

import numpy as np
import torch

PAGES = [4096, 1024, 160]
REMOTE_BLOCKS = 48
LOCAL_BLOCKS = 40


def scattered_pairs(seed: int, n: int = 17) -> list[tuple[int, int]]:
    """A run of consecutive blocks plus random scattered pairs (remote ids may repeat)."""
    rng = np.random.default_rng(seed)
    local = rng.choice(np.arange(3, LOCAL_BLOCKS), size=n, replace=False)
    remote = rng.integers(0, REMOTE_BLOCKS, size=n)
    pairs = [(10, 0), (11, 1), (12, 2), *list(zip(remote.tolist(), local.tolist(), strict=False))]
    return pairs


def expected_after(before: list[torch.Tensor], source: list[torch.Tensor], pairs) -> list[torch.Tensor]:
    out = [t.clone() for t in before]
    for s, dst in enumerate(out):
        for remote, local in pairs:
            dst[local] = source[s][remote]
    return out


def fill(slots: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for t in slots:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    return [t.clone() for t in slots]


def assert_plain(value) -> None:
    """``value`` is plain data (nested tuples of str, int and bytes): what an AgentInfo may hold."""
    if isinstance(value, tuple):
        for v in value:
            assert_plain(v)
    else:
        assert type(value) in (str, int, bytes), type(value)
