"""Markers and fixtures of the model tests: ``device``, and the GGUF tests' ``tiny_gguf`` and ``fake_convert``."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.checkpoints import gguf as g
from tests.model.gguf_files import FakeConvert, write_tiny_gguf
from tests.model.logits_harness import DEVICES


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: converts or runs real checkpoints (minutes); deselect with -m 'not slow'")


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device the logits tests run on: the CPU, and CUDA where there is one."""
    return request.param


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture
def fake_convert(monkeypatch) -> FakeConvert:
    fake = FakeConvert()
    monkeypatch.setattr(g, "convert_gguf", fake)
    return fake
