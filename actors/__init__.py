"""Thin Ray actor wrappers (prefill worker, decode worker, router): lifecycle and health, no policy."""
