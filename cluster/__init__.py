"""kvfleet's driver layer: the `Cluster` API over Ray actors (the CLI and the job entry point live in `kvfleet`).

``from cluster import Cluster`` loads Ray and torch lazily (the CLI's ``config`` command needs neither).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("Cluster", "ClusterCompletion"):
        from cluster import api

        return getattr(api, name)
    raise AttributeError(name)
