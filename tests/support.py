"""Helpers shared by the test packages: one local Ray (loopback, no dashboard, enough logical
CPUs, both role resources, never attached to another cluster on this machine), a bounded wait,
and the preset loader on the test device (``kvfleet_testing.presets.load_preset``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvfleet_testing.presets import load_preset  # noqa: F401  (the tests import it from here)

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
