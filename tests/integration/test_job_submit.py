"""`ray start --head` on loopback + `ray job submit` of `python -m cluster.job`: the job attaches
to that cluster, runs the prompts and writes the JSONL the single engine predicts.

The head runs as `ray start --block` in its own session, so SIGTERM to that one process stops
exactly this cluster (never `ray stop`, which would also stop the tests' own Ray). Token auth
is requested explicitly (RAY_AUTH_MODE=token, with a token made here in RAY_AUTH_TOKEN) for the
head, the client and the job alike, so the test does not depend on what is in ~/.ray.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs import load_config
from tests.integration.conftest import oracle_tokens

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY = shutil.which("ray", path=str(BIN)) or shutil.which("ray")
PROMPTS = ["The capital of France is", "x", "a longer prompt that goes through a prefill worker and a KV transfer " * 2]
MAX_TOKENS = 6
TOKEN = secrets.token_hex(16)


def _free_port(preferred: int | None = None) -> int:
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",  # the job's `python` is the venv's
        RAY_USAGE_STATS_ENABLED="0",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=TOKEN,  # this test's own token: nothing read from (or left in) ~/.ray
        UCX_NET_DEVICES="lo",
    )
    return env


def _job(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster.job", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=_env(), check=False)  # fmt: skip


@pytest.mark.skipif(RAY is None, reason="the ray CLI is not installed")
def test_ray_job_submit_runs_the_entrypoint(tmp_path):
    gcs_port, dashboard_port = _free_port(), _free_port(8265)
    inputs = tmp_path / "prompts.jsonl"
    inputs.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    output = tmp_path / "results.jsonl"
    log_path = tmp_path / "head.log"
    env = _env()
    with open(log_path, "w") as head_log:
        head = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port),
             "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
             # free ports for what has fixed defaults (the tests' own Ray holds the agent's 52365)
             "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port()),
             "--ray-client-server-port", str(_free_port()),
             "--num-cpus", "4", "--resources", json.dumps({"prefill": 2, "decode": 2}),
             "--object-store-memory", str(200 * 1024**2)],
            stdout=head_log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while "block forever" not in log_path.read_text():
            assert head.poll() is None, f"ray start exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ray start not ready:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        command = [RAY, "job", "submit", "--address", f"http://127.0.0.1:{dashboard_port}", "--working-dir", str(REPO),
                   "--", "python", "-m", "cluster.job", "--config", "tiny", "--input", str(inputs),
                   "--output", str(output), "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]  # fmt: skip
        deadline = time.monotonic() + 60
        while True:  # the head's job agent may come up a little after `ray start` reports ready
            submit = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, check=False)
            if "No available agent" not in submit.stdout + submit.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
        assert "succeeded" in submit.stdout + submit.stderr
    finally:
        head.send_signal(signal.SIGTERM)  # drains and stops this head's processes only
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        current = Path("/tmp/ray/ray_current_cluster")  # `ray start` wrote it; only `ray stop` removes it
        if current.is_file() and current.read_text().strip() == f"127.0.0.1:{gcs_port}":
            current.unlink()

    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["id"] for r in results] == ["p0", "p1", "p2"]
    from engine.sampling_params import SamplingParams

    prompt_ids = [list(p.encode()) for p in PROMPTS]  # tiny models: byte vocabulary
    expected = oracle_tokens(load_config("tiny"), prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [r["token_ids"] for r in results] == expected
    assert all(r["finish_reason"] == "length" for r in results)
    assert results[2]["prefill_worker"] == "prefill-0"  # the long prompt went through P/D


def test_job_exits_non_zero_on_bad_config_or_input(tmp_path):
    missing = _job("--config", "tiny", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o"))
    assert missing.returncode == 2 and "missing.jsonl" in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    result = _job("--config", "tiny", "--input", str(bad), "--output", str(tmp_path / "o"))
    assert result.returncode == 2 and "bad.jsonl:1: expected an object with a 'prompt' field" in result.stderr
    result = _job("--config", "tiny", "--set", "workers.num_decode=0", "--input", str(bad), "--output", "o")
    assert result.returncode == 2 and "workers.num_decode: must be >= 1 (got 0)" in result.stderr
    assert "Traceback" not in result.stderr
