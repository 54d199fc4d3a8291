"""Configs the harnesses and tests start from: a preset on the test device, and a P/D cluster shape.

Owns the device switch (``KVFLEET_TEST_DEVICE``, read by ``device_overrides``), the preset loader
that applies it (``load_preset``), the cluster-shape loader (``cluster_config``) and the fast
health-check overrides the failure tests and the chaos harness share (``FAST_HEALTH``).
Invariants: with ``KVFLEET_TEST_DEVICE`` unset every config is exactly the preset's with the
given overrides; explicit overrides win over the device switch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from configs import ClusterConfig, load_config

FAST_HEALTH = (
    "workers.health_check_interval_s=0.5",
    "workers.health_check_timeout_s=3",
    "workers.request_lease_s=8",
)


def device_overrides() -> list[str]:
    """``["model.device=<KVFLEET_TEST_DEVICE>"]``: the device the engine tests run their engines
    on (``KVFLEET_TEST_DEVICE=cuda`` on a GPU host). Unset: no override, so the preset's own
    device (cpu for every tiny preset) and configs exactly as without the switch."""
    device = os.environ.get("KVFLEET_TEST_DEVICE", "")
    return [f"model.device={device}"] if device else []


def load_preset(preset: str, overrides: Sequence[str] = ()) -> ClusterConfig:
    """``load_config(preset, overrides)`` on the test device (explicit overrides win)."""
    return load_config(preset, [*device_overrides(), *overrides])


def cluster_config(preset: str, num_prefill: int, num_decode: int, *overrides: str) -> ClusterConfig:
    """``preset`` with ``num_prefill`` prefill and ``num_decode`` decode workers, then ``overrides``."""
    return load_config(preset, [f"workers.num_prefill={num_prefill}", f"workers.num_decode={num_decode}", *overrides])
