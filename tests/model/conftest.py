"""Markers and the ``device`` fixture of the model tests."""

from __future__ import annotations

import pytest

from tests.model.logits_harness import DEVICES


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: converts or runs real checkpoints (minutes); deselect with -m 'not slow'"
    )


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device the logits tests run on: the CPU, and CUDA where there is one."""
    return request.param
