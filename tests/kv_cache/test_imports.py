"""engine.kv_cache is pure Python: importing it pulls in neither torch nor ray."""

from __future__ import annotations

import subprocess
import sys


def test_kv_cache_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys, engine.kv_cache, engine.kv_cache.coordinator, engine.kv_cache.managers;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
