"""The `kvfleet` CLI: help, config printing, exit code 2 without a traceback on a bad config or a
bad command-line value, exit code 3 with an error record per bad JSONL line while the good lines
run. ``FakeCluster`` stands in for the cluster (the real one runs in tests/integration)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, Self

import pytest
import yaml

from configs import load_config
from engine.sampling_params import SamplingParams
from kvfleet.cli import main


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_help_lists_the_subcommands() -> None:
    result = _run("--help")
    assert result.returncode == 0
    assert "config" in result.stdout and "generate" in result.stdout


def test_bad_override_exits_2_naming_the_field() -> None:
    result = _run("config", "--config", "local", "--set", "workers.num_decode=-1")
    assert result.returncode == 2
    assert "workers.num_decode: must be >= 1 (got -1)" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_preset_exits_2(capsys) -> None:  # in-process: no interpreter start-up
    assert main(["config", "--config", "does-not-exist"]) == 2
    assert "config: unknown preset 'does-not-exist'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["config", "--config", "nope"], ["generate", "--config", "nope", "hello"]])
def test_unknown_preset_says_what_on_one_line(capsys, argv: list[str]) -> None:
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvfleet: invalid configuration: config: unknown preset 'nope' (available: ")
    assert "tiny" in line


def test_malformed_override_exits_2(capsys) -> None:
    assert main(["config", "--set", "workers.num_decode"]) == 2
    assert "expected dotted.key=value" in capsys.readouterr().err


def test_config_prints_yaml_that_reloads(capsys, tmp_path) -> None:
    assert main(["config", "--config", "tiny", "--set", "workers.num_decode=2"]) == 0
    printed = capsys.readouterr().out
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    assert load_config(path) == load_config("tiny", ["workers.num_decode=2"])
    assert yaml.safe_load(printed)["workers"]["num_decode"] == 2


def test_help_lists_the_commands_and_no_benchmark(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(command in out for command in ("config", "generate", "serve"))
    assert "bench" not in out  # benchmarks run from the repository: python -m benchmarks.cluster_bench


def test_generate_rejects_bad_prompts_before_starting_a_cluster(capsys, no_cluster) -> None:
    assert main(["generate", "--config", "tiny", ""]) == 2
    assert "prompt: must not be empty (got '')" in capsys.readouterr().err
    assert main(["generate", "--config", "tiny", "--max-tokens", "0", "hello"]) == 2
    assert "max_tokens: must be >= 1 (got 0)" in capsys.readouterr().err
    assert main(["generate", "--config", "tiny"]) == 2
    assert "needs at least one prompt" in capsys.readouterr().err


# -- generate and JSONL runs against a stand-in cluster ------------------------------------------

MAX_MODEL_LEN = 64  # the stand-in's context: longer prompts fail its check like the real one


class FakeCluster:
    """The part of ``cluster.api.Cluster`` the CLI uses: start/stop, ``check_prompt`` (the same
    rules, ``engine.validation.validate_prompt``, on a byte vocabulary) and ``generate`` (takes
    the checked prompts and echoes them)."""

    started: ClassVar[list[FakeCluster]] = []
    fail_next: Exception | None = None
    fail_prompts: ClassVar[dict[str, Exception]] = {}  # prompt text -> the error that request fails with

    def __init__(self, config: Any):
        self.config = config
        self.ran: list[tuple[Any, Any, Any]] = []

    def __enter__(self) -> Self:
        FakeCluster.started.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def check_prompt(self, prompt: Any, cache_salt: Any = None) -> Any:
        from engine.validation import validate_prompt

        return validate_prompt(prompt, 256, MAX_MODEL_LEN, lambda text: list(text.encode()), cache_salt)

    def generate(self, prompts, samplings, request_ids=None, on_completion=None, return_exceptions=False) -> list[Any]:
        from engine.validation import ValidatedPrompt

        if FakeCluster.fail_next is not None:
            raise FakeCluster.fail_next
        out: list[Any] = []
        for prompt, sampling, request_id in zip(prompts, samplings, request_ids or [None] * len(prompts), strict=True):
            assert isinstance(prompt, ValidatedPrompt), "the CLI hands over the prompts the cluster checked"
            self.ran.append((prompt.text if prompt.text is not None else list(prompt.token_ids), sampling, request_id))
            ids = list(prompt.token_ids)
            text = prompt.text if prompt.text is not None else bytes(ids).decode()
            if text in FakeCluster.fail_prompts:
                if not return_exceptions:
                    raise FakeCluster.fail_prompts[text]
                out.append(FakeCluster.fail_prompts[text])
                continue
            out.append(
                SimpleNamespace(
                    prompt=text, text=text[::-1], token_ids=ids[::-1][: sampling.max_tokens], finish_reason="length"
                )
            )
            if on_completion is not None:
                on_completion(out[-1])
        return out


@pytest.fixture
def fake_cluster(monkeypatch) -> type[FakeCluster]:
    import cluster.api

    FakeCluster.started = []
    FakeCluster.fail_next = None
    FakeCluster.fail_prompts = {}
    monkeypatch.setattr(cluster.api, "Cluster", FakeCluster)
    return FakeCluster


@pytest.fixture
def no_cluster(monkeypatch) -> None:
    import cluster.api

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(cluster.api, "Cluster", refuse)


BAD_OPTIONS = [
    (["--temperature", "nan"], "temperature: must be a finite number (got nan)"),
    (["--temperature", "inf"], "temperature: must be a finite number (got inf)"),
    (["--temperature=-inf"], "temperature: must be a finite number (got -inf)"),
    (["--temperature", "-1"], "temperature: must be >= 0.0 (got -1.0)"),
    (["--temperature", "1e-9"], "temperature: must be 0 (greedy) or >= 0.001 (got 1e-09)"),
    (["--top-p", "nan"], "top_p: must be a finite number (got nan)"),
    (["--top-p", "0"], "top_p: must be > 0.0 (got 0.0)"),
    (["--top-p", "1.5"], "top_p: must be <= 1.0 (got 1.5)"),
    (["--top-k", "-1"], "top_k: must be >= 0 (got -1)"),
    (["--max-tokens", "-5"], "max_tokens: must be >= 1 (got -5)"),
    (["--seed", str(2**64)], f"seed: must fit in 64 bits (got {2**64})"),
    (["--stop", ""], "stop: stop strings must be non-empty (got ('',))"),
]


@pytest.mark.parametrize("options,message", BAD_OPTIONS, ids=[" ".join(o) for o, _ in BAD_OPTIONS])
def test_bad_sampling_options_exit_2_naming_the_field(capsys, no_cluster, options: list[str], message: str) -> None:
    assert main(["generate", "--config", "tiny", *options, "hello"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvfleet: {message}\n"


def test_an_option_argparse_cannot_parse_is_a_usage_error(capsys, no_cluster) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--config", "tiny", "--max-tokens", "5.5", "hello"])
    assert caught.value.code == 2
    assert "argument --max-tokens: invalid int value: '5.5'" in capsys.readouterr().err


def _jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_jsonl_run_with_bad_lines_runs_the_good_ones_and_exits_3(capsys, tmp_path, fake_cluster) -> None:
    inputs = _jsonl(
        tmp_path / "in.jsonl",
        '{"id": "a", "prompt": "good one"}',
        '{"id": "b", "prompt": "x", "temperature": NaN}',
        '{"id": "c", "prompt": null}',
        "",
        '{"id": "d", "prompt": [104, 105], "max_tokens": 1}',
        '{"id": "e", "prompt": "' + "y" * MAX_MODEL_LEN + '"}',  # fails only the cluster's own check
        '{"id": "f", "prompt": "x", "max_tokens": "5"}',
        "not json",
    )
    output = tmp_path / "out.jsonl"
    assert main(["generate", "--config", "tiny", "--input", str(inputs), "--output", str(output), "--no-progress"]) == 3
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"kvfleet: {inputs}:2: temperature: must be a finite number (got nan)",
        f"kvfleet: {inputs}:3: prompt: must be text or a list of token ids (got None)",
        f"kvfleet: {inputs}:7: max_tokens: must be an integer (got '5')",
        f"kvfleet: {inputs}:8: line: not valid JSON (Expecting value at column 1)",
        (
            f"kvfleet: {inputs}:6: prompt: {MAX_MODEL_LEN} tokens leave no room to generate within max_model_len=64 "
            f"(got a prompt of {MAX_MODEL_LEN} tokens)"
        ),
        "kvfleet: 5 of 7 input lines failed; each has an error record in the output",
    ]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert records == [
        {
            "id": "a",
            "prompt": "good one",
            "text": "eno doog",
            "token_ids": list(b"good one"[::-1][:32]),
            "finish_reason": "length",
        },
        {"id": "b", "line": 2, "error": "temperature: must be a finite number (got nan)"},
        {"id": "c", "line": 3, "error": "prompt: must be text or a list of token ids (got None)"},
        {"id": "d", "prompt": "hi", "text": "ih", "token_ids": [105], "finish_reason": "length"},
        {
            "id": "e",
            "line": 6,
            "error": f"prompt: {MAX_MODEL_LEN} tokens leave no room to generate within max_model_len=64 "
            f"(got a prompt of {MAX_MODEL_LEN} tokens)",
        },
        {"id": "f", "line": 7, "error": "max_tokens: must be an integer (got '5')"},
        {"line": 8, "error": "line: not valid JSON (Expecting value at column 1)"},
    ]
    (ran,) = fake_cluster.started
    assert [(prompt, request_id) for prompt, _, request_id in ran.ran] == [("good one", "a"), ([104, 105], "d")]


def test_a_clean_jsonl_run_exits_0(capsys, tmp_path, fake_cluster) -> None:
    inputs = _jsonl(tmp_path / "in.jsonl", '{"prompt": "one"}', '{"prompt": "two", "temperature": 0.5, "seed": 1}')
    assert main(["generate", "--config", "tiny", "--input", str(inputs), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["text"] for line in captured.out.splitlines()] == ["eno", "owt"]
    assert "failed" not in captured.err
    assert fake_cluster.started[0].ran[1][1] == SamplingParams(max_tokens=32, temperature=0.5, seed=1)


def test_every_line_bad_exits_3_without_starting_a_cluster(capsys, tmp_path, no_cluster) -> None:
    inputs = _jsonl(tmp_path / "in.jsonl", '{"prompt": ""}', '{"prompt": "x", "top_p": Infinity}')
    output = tmp_path / "out.jsonl"
    assert main(["generate", "--config", "tiny", "--input", str(inputs), "--output", str(output)]) == 3
    assert "2 of 2 input lines failed" in capsys.readouterr().err
    assert [json.loads(line) for line in output.read_text().splitlines()] == [
        {"line": 1, "error": "prompt: must not be empty (got '')"},
        {"line": 2, "error": "top_p: must be a finite number (got inf)"},
    ]


def test_a_command_line_prompt_the_cluster_refuses_is_a_bad_invocation(capsys, tmp_path, fake_cluster) -> None:
    inputs = _jsonl(tmp_path / "in.jsonl", '{"prompt": "fine"}')
    too_long = "z" * MAX_MODEL_LEN
    assert main(["generate", "--config", "tiny", too_long, "--input", str(inputs), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert f"kvfleet: prompt: {MAX_MODEL_LEN} tokens leave no room" in captured.err
    assert captured.out == "" and fake_cluster.started[0].ran == []  # nothing ran


def test_a_missing_input_file_is_a_bad_invocation(capsys, tmp_path, no_cluster) -> None:
    assert main(["generate", "--config", "tiny", "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_a_cluster_failure_exits_1(capsys, tmp_path, fake_cluster) -> None:
    fake_cluster.fail_next = RuntimeError("decode-0: worker died")
    assert main(["generate", "--config", "tiny", "hello", "--no-progress"]) == 1
    assert "generation failed: RuntimeError: decode-0: worker died" in capsys.readouterr().err


def test_a_request_that_fails_on_a_worker_fails_its_line_only(capsys, tmp_path, fake_cluster) -> None:
    why = "decode-0: request r failed on the worker: sampling failed: invalid multinomial distribution"
    fake_cluster.fail_prompts = {"boom": RuntimeError(why)}
    inputs = _jsonl(
        tmp_path / "in.jsonl",
        '{"id": "a", "prompt": "one"}',
        '{"id": "b", "prompt": "boom"}',
        '{"id": "c", "prompt": "two"}',
    )
    output = tmp_path / "out.jsonl"
    assert main(["generate", "--config", "tiny", "--input", str(inputs), "--output", str(output), "--no-progress"]) == 3
    assert f"kvfleet: {inputs}:2: request failed: {why}" in capsys.readouterr().err.splitlines()
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r.get("text") for r in records] == ["eno", None, "owt"]
    assert records[1] == {"id": "b", "line": 2, "error": f"request failed: {why}"}


def test_the_job_entrypoint_reports_lines_and_exits_3(capsys, tmp_path, fake_cluster) -> None:
    from kvfleet.job import main as job_main

    inputs = _jsonl(tmp_path / "in.jsonl", '{"prompt": "ok"}', '{"prompt": "x", "temperature": NaN}')
    output = tmp_path / "out.jsonl"
    assert job_main(["--config", "tiny", "--input", str(inputs), "--output", str(output)]) == 3
    assert f"kvfleet.job: {inputs}:2: temperature: must be a finite number (got nan)" in capsys.readouterr().err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert records[0]["text"] == "ko" and records[1] == {
        "line": 2,
        "error": "temperature: must be a finite number (got nan)",
    }


@pytest.mark.parametrize(
    "options,message",
    [
        (["--temperature", "nan"], "kvfleet.job: temperature: must be a finite number (got nan)"),
        (["--max-tokens", "0"], "kvfleet.job: max_tokens: must be >= 1 (got 0)"),
        (["--config", "nope"], "kvfleet.job: invalid configuration: config: unknown preset 'nope' (available: "),
    ],
)
def test_the_job_entrypoint_refuses_bad_options_with_exit_2(capsys, tmp_path, no_cluster, options, message) -> None:
    from kvfleet.job import main as job_main

    inputs = _jsonl(tmp_path / "in.jsonl", '{"prompt": "ok"}')
    assert job_main(["--config", "tiny", *options, "--input", str(inputs), "--output", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert not (tmp_path / "o").exists()


def test_nan_is_refused_however_it_is_spelled(capsys, no_cluster) -> None:
    for spelling in ("nan", "NaN", "-nan", "NAN"):
        assert main(["generate", "--config", "tiny", f"--temperature={spelling}", "x"]) == 2
        assert "temperature: must be a finite number (got nan)" in capsys.readouterr().err
