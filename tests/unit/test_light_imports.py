"""The processes that never run a model start without loading what only a model needs: the
driver API (``cluster.api``), the HTTP ingress (``serving.app``) and the router actor
(``actors.router``) import no torch, and an engine imports neither torch._dynamo nor xgrammar
until something asks for them (a Ray worker pays every import on each start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules_after(code: str) -> set[str]:
    """The top-level and dotted module names loaded once ``code`` ran in a fresh interpreter."""
    script = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", script], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(out.stdout.split())


def test_the_driver_the_ingress_and_the_router_import_no_torch() -> None:
    loaded = modules_after("import cluster.api, serving.app, actors.router")
    assert "torch" not in loaded
    assert "xgrammar" not in loaded


def test_an_engine_is_built_without_dynamo_or_xgrammar() -> None:
    code = (
        "from configs import load_config\n"
        "from engine.core import EngineCore\n"
        "from engine.sampling_params import SamplingParams\n"
        "engine = EngineCore(load_config('tiny'), threads=1)\n"
        "engine.add_request('r', [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))\n"
        "while engine.has_work:\n"
        "    engine.step()\n"
    )
    loaded = modules_after(code)
    assert "torch" in loaded  # the check itself: the engine ran
    assert "torch._dynamo" not in loaded
    assert "xgrammar" not in loaded
