"""Markers for the model tests."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: converts or runs real checkpoints (minutes); deselect with -m 'not slow'"
    )
