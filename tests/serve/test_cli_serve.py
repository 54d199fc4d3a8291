"""``kvfleet serve`` as a user runs it: it prints the URL, answers the OpenAI client, and on
SIGTERM drains the request in flight (it completes whole) and exits 0; its log shows the
lifecycle and, at the preset's WARNING level, no per-request access lines."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvfleet_testing.ports import free_port

BIN = Path(sys.executable).parent
KVFLEET = shutil.which("kvfleet", path=str(BIN)) or shutil.which("kvfleet")
START_TIMEOUT_S = 180
MAX_TOKENS = 400


def _read_lines(stream: object, into: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)


def test_kvfleet_serve_prints_its_url_serves_and_drains_on_sigterm(tmp_path: Path) -> None:
    assert KVFLEET is not None, "the kvfleet console script is not installed"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    process = subprocess.Popen(
        [KVFLEET, "serve", "--config", "tiny", "--port", str(port), "--set", "ray.num_cpus=4"],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "stderr.log").open("w"),
        text=True,
        env=env,
        cwd=tmp_path,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True).start()
    try:
        url = None
        deadline = time.monotonic() + START_TIMEOUT_S
        while url is None and time.monotonic() < deadline and process.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if "serving" in line and "http://" in line:
                url = line.split(" at ", 1)[1].split()[0]
        assert url == f"http://127.0.0.1:{port}", (url, (tmp_path / "stderr.log").read_text()[-3000:])

        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        # greedy and ignore_eos: a sampled EOS (about 1 in 400 at temperature 1 on this random model)
        # would end the completion early
        first = client.completions.create(
            model="tiny-gemma3", prompt="hi", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
        )
        assert first.usage is not None and first.usage.completion_tokens == 2

        body = {
            "model": "tiny-gemma3",
            "prompt": "drain me " * 5,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events: list[dict[str, object]] = []
        at_signal = -1
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 3:
                    at_signal = len(events)
                    process.send_signal(signal.SIGTERM)
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS, usage  # type: ignore[index]
        assert len(events) > at_signal + 10, "the request had already finished when SIGTERM arrived"
        assert process.wait(timeout=90) == 0
        logged = (tmp_path / "stderr.log").read_text()
        # the tiny preset logs at WARNING: kvfleet's lifecycle shows, Serve's INFO access lines do not
        assert "draining in-flight requests" in logged and "stopped" in logged, logged[-3000:]
        assert "POST /v1/completions" not in logged, logged[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
