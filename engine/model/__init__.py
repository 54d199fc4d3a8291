"""Torch models, their KV layout and the step batch; the only place (with runner/transfer) torch lives."""
