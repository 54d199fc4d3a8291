"""Where the Triton kernel tests (test_triton_*.py) run, and the fixes to triton 3.6's interpreter
they need on CPU runs (``TRITON_INTERPRET=1`` itself is set by tests/conftest.py before any module
is collected: triton reads it when its language module is first imported)."""

from __future__ import annotations

import os

import torch

from engine.model.kernels.interpreter import patch_interpreter

__all__ = ["kernel_test_device", "patch_interpreter"]


def kernel_test_device() -> str:
    """``"cuda"`` where there is a GPU (the kernels run compiled); otherwise ``"cpu"``, with the
    interpreter patched (``patch_interpreter``). Call after ``pytest.importorskip("triton")``."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton kernel tests need TRITON_INTERPRET=1 on CPU (tests/conftest.py sets it)")
    patch_interpreter()
    return "cpu"
