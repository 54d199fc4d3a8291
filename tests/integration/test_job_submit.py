"""`ray start --head` on loopback + `ray job submit` of `python -m kvfleet.job`: the job attaches
to that cluster, runs the prompts and writes the JSONL the single engine predicts.

The head runs as `ray start --block` in its own session, so SIGTERM to that one process stops
exactly this cluster (never `ray stop`, which would also stop the tests' own Ray). Token auth
is requested explicitly (RAY_AUTH_MODE=token, with a token made here in RAY_AUTH_TOKEN) for the
head, the client and the job alike, so the test does not depend on what is in ~/.ray.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs import load_config
from kvfleet_testing.ports import free_port
from tests.integration.conftest import oracle_tokens

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY = shutil.which("ray", path=str(BIN)) or shutil.which("ray")
PROMPTS = ["The capital of France is", "x", "a longer prompt that goes through a prefill worker and a KV transfer " * 2]
MAX_TOKENS = 6
TOKEN = secrets.token_hex(16)


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
    return subprocess.run(
        [sys.executable, "-m", "kvfleet.job", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=_env(),
        check=False,
    )


@pytest.mark.skipif(RAY is None, reason="the ray CLI is not installed")
def test_ray_job_submit_runs_the_entrypoint(tmp_path):
    gcs_port, dashboard_port = free_port(), free_port(preferred=8265)
    inputs = tmp_path / "prompts.jsonl"
    inputs.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    output = tmp_path / "results.jsonl"
    log_path = tmp_path / "head.log"
    env = _env()
    with open(log_path, "w") as head_log:
        head = subprocess.Popen(
            [
                RAY,
                "start",
                "--head",
                "--block",
                "--node-ip-address",
                "127.0.0.1",
                "--port",
                str(gcs_port),
                "--include-dashboard",
                "true",
                "--dashboard-host",
                "127.0.0.1",
                "--dashboard-port",
                str(dashboard_port),
                # free ports for what has fixed defaults (the tests' own Ray holds the agent's 52365)
                "--dashboard-agent-listen-port",
                str(free_port()),
                "--metrics-export-port",
                str(free_port()),
                "--ray-client-server-port",
                str(free_port()),
                "--num-cpus",
                "4",
                "--resources",
                json.dumps({"prefill": 2, "decode": 2}),
                "--object-store-memory",
                str(200 * 1024**2),
            ],
            stdout=head_log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while "block forever" not in log_path.read_text():
            assert head.poll() is None, f"ray start exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ray start not ready:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        command = [
            RAY,
            "job",
            "submit",
            "--address",
            f"http://127.0.0.1:{dashboard_port}",
            "--working-dir",
            str(REPO),
            "--",
            "python",
            "-m",
            "kvfleet.job",
            "--config",
            "tiny",
            "--input",
            str(inputs),
            "--output",
            str(output),
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
        ]
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
    output = tmp_path / "o.jsonl"
    result = _job("--config", "tiny", "--input", str(bad), "--output", str(output))  # every line bad: no cluster
    assert result.returncode == 3 and "bad.jsonl:1: text: unknown field (got 'no prompt field')" in result.stderr
    assert json.loads(output.read_text()) == {"line": 1, "error": "text: unknown field (got 'no prompt field')"}
    result = _job("--config", "tiny", "--set", "workers.num_decode=0", "--input", str(bad), "--output", "o")
    assert result.returncode == 2 and "workers.num_decode: must be >= 1 (got 0)" in result.stderr
    result = _job("--config", "tiny", "--temperature", "nan", "--input", str(bad), "--output", "o")
    assert result.returncode == 2 and "kvfleet.job: temperature: must be a finite number (got nan)" in result.stderr
    assert "Traceback" not in result.stderr


def test_job_runs_the_good_lines_and_records_the_bad_ones(ray_session, tmp_path, capsys):
    """``python -m kvfleet.job``'s main in-process on the tests' Ray: exit 3, the good lines'
    tokens equal the single engine's, an error record in place of each bad line."""
    from engine.sampling_params import SamplingParams
    from kvfleet.job import main

    config = load_config("tiny")
    good = [list(b"The capital of France is"), list(b"a longer prompt that goes through P/D " * 2)]
    lines = [
        {"id": "g0", "prompt": "The capital of France is"},  # text: the tiny tokenizer is bytes
        {"id": "nan", "prompt": "x", "temperature": math.nan},
        {"id": "vocab", "prompt": [1, 2, 999]},
        {"id": "long", "prompt": [5] * 600},  # the tiny model's context is 512 tokens
        {"id": "g1", "prompt": good[1]},
        {"id": "str", "prompt": "x", "max_tokens": "5"},
    ]
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    argv = [
        "--config",
        "tiny",
        "--input",
        str(inputs),
        "--output",
        str(output),
        "--max-tokens",
        str(MAX_TOKENS),
        "--ignore-eos",
    ]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert f"{inputs}:2: temperature: must be a finite number (got nan)" in err
    assert f"{inputs}:3: prompt: token id 999 is outside the vocabulary [0, 256) (position 2 of 3)" in err
    assert f"{inputs}:4: prompt: 600 tokens leave no room to generate within max_model_len=512" in err
    assert f"{inputs}:6: max_tokens: must be an integer (got '5')" in err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["id"] for r in records] == ["g0", "nan", "vocab", "long", "g1", "str"]
    assert [r.get("line") for r in records] == [None, 2, 3, 4, None, 6]
    expected = oracle_tokens(config, good, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [records[0]["token_ids"], records[4]["token_ids"]] == expected
    assert all("error" in records[i] and "token_ids" not in records[i] for i in (1, 2, 3, 5))
