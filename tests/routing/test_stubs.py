"""The compiled routing modules' ``.pyi`` files against the built extensions: ``mypy.stubtest``
compares each stub's classes, methods and signatures with what the module exports at runtime, so
a method added to (or dropped from) ``_core.c``, ``_load.c``, ``_inflight.c`` or ``_reuse.c`` without its stub
fails here. Needs the extensions built (``python setup.py build_ext --inplace``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.routing.holder_maps import compiled_available

MODULES = ("engine.routing._core", "engine.routing._load", "engine.routing._inflight", "engine.routing._reuse")
ROOT = Path(__file__).resolve().parents[2]


def test_the_compiled_modules_match_their_stubs() -> None:
    assert compiled_available(), "the routing extensions are not built: run `python setup.py build_ext --inplace`"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", *MODULES],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
