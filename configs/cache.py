"""Where kvfleet keeps what it builds once and reuses: converted GGUF models (``models/``) and
tiny random checkpoints (``tiny/``). One rule for the whole project, documented in
docs/architecture.md ("Kernels and caches")."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVFLEET_CACHE``, else ``$XDG_CACHE_HOME/kvfleet``, else ``~/.cache/kvfleet``."""
    if os.environ.get("KVFLEET_CACHE"):
        return Path(os.environ["KVFLEET_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvfleet"
    return Path.home() / ".cache" / "kvfleet"
