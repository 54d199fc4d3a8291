"""kvfleet's user-facing layer: the driver API, the `kvfleet` CLI and the `ray job submit` entrypoint."""
