"""The load generator of ``benchmarks/serve_bench.py``: guidellm, found, checked and driven.

Owns the tool's name (``TOOL``), its executable (``find_tool``), its version and the one
pyproject.toml's ``bench`` extra pins (``tool_version``, ``pinned_version``), its environment
(``tool_env``) and one constant-rate run of it with its benchmark report (``run_tool``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOOL = "guidellm"


def find_tool(explicit: str | None) -> str:
    """guidellm's executable: --guidellm, $KVFLEET_GUIDELLM, next to this Python, then PATH."""
    candidates = [
        explicit,
        os.environ.get("KVFLEET_GUIDELLM"),
        str(Path(sys.executable).parent / TOOL),
        shutil.which(TOOL),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit(
        f"serve_bench: no {TOOL} executable; install it (see this script's docstring) and pass "
        f"--guidellm PATH or set KVFLEET_GUIDELLM"
    )


def tool_version(tool: str) -> str:
    out = subprocess.run(
        [tool, "--version"], capture_output=True, text=True, timeout=300, env=tool_env(), check=False
    ).stdout
    match = re.search(r"(\d+\.\d+[\w.\-+]*)", out)
    return match.group(1) if match else out.strip()


def pinned_version() -> str | None:
    """The exact version pyproject.toml's ``bench`` extra pins the load generator at."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    for requirement in extras.get("bench", []):
        name, _, version = requirement.partition("==")
        if name.strip().lower() == TOOL:
            return version.strip()
    return None


def tool_env() -> dict[str, str]:
    """guidellm offline (the tokenizer is a local directory), one worker process (2-core box)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}


def run_tool(
    tool: str, url: str, model: str, data: Path, tokenizer_dir: Path, rate: float, count: int, out_dir: Path
) -> dict[str, Any]:
    """guidellm at a constant ``rate`` for ``count`` requests of ``data``; its benchmark report."""
    report = out_dir / "report.json"
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "request_format": "/v1/completions",
                "http2": False,
                "timeout": 600.0,
                "extras": {"body": {"temperature": 0.0}},
            },
            "profile": {"kind": "constant", "rate": [rate]},
            "constraints": [{"kind": "max_requests", "count": count}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "data": [{"kind": "json_file", "path": str(data)}],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }
    (out_dir / "scenario.json").write_text(json.dumps(scenario, indent=1))
    cmd = [tool, "run", "--config", str(out_dir / "scenario.json"), "--disable-console-interactive"]
    with (out_dir / "guidellm.log").open("w") as out:
        done = subprocess.run(
            cmd,
            cwd=out_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=tool_env(),
            timeout=count / rate + 600,
            check=False,
        )
    if done.returncode != 0 or not report.is_file():
        raise RuntimeError(f"{TOOL} exited with {done.returncode}; see {out_dir / 'guidellm.log'}")
    return json.loads(report.read_text())["benchmarks"][0]
