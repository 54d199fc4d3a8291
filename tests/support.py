"""Helpers shared by the test packages: one local Ray (loopback, no dashboard, enough logical
CPUs, both role resources, never attached to another cluster on this machine), a bounded wait,
and the device switch of the engine tests (``KVFLEET_TEST_DEVICE``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from configs.schema import ClusterConfig

# Logical CPUs: the largest cluster here (2 prefill + 2 decode workers at 0.5 CPU each) fits many
# times over; Ray's num_cpus is a count, not cores, so this never leaves an actor pending.
RAY_NUM_CPUS = 8


def init_local_ray(namespace: str) -> None:
    import ray

    ray.init(
        address="local",
        num_cpus=RAY_NUM_CPUS,
        resources={"prefill": 4, "decode": 4},
        include_dashboard=False,
        object_store_memory=256 * 1024**2,
        _node_ip_address="127.0.0.1",
        namespace=namespace,
        log_to_driver=False,
    )


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def device_overrides() -> list[str]:
    """``["model.device=<KVFLEET_TEST_DEVICE>"]``: the device the engine tests run their engines
    on (``KVFLEET_TEST_DEVICE=cuda`` on a GPU host). Unset: no override, so the preset's own
    device (cpu for every tiny preset) and configs exactly as without the switch."""
    device = os.environ.get("KVFLEET_TEST_DEVICE", "")
    return [f"model.device={device}"] if device else []


def load_preset(preset: str, overrides: Sequence[str] = ()) -> ClusterConfig:
    """``load_config(preset, overrides)`` on the test device (explicit overrides win)."""
    from configs import load_config

    return load_config(preset, [*device_overrides(), *overrides])
