"""The `kvfleet` CLI: help, config printing, and exit code 2 without a traceback on bad config."""

from __future__ import annotations

import subprocess
import sys

import yaml

from cluster.cli import main
from configs import load_config


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=120, check=False
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


def test_help_lists_bench(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "bench" in capsys.readouterr().out


def test_generate_rejects_bad_prompts_before_starting_a_cluster(capsys, tmp_path) -> None:
    assert main(["generate", "--config", "tiny", ""]) == 2
    assert "prompt: must not be empty (got '')" in capsys.readouterr().err
    assert main(["generate", "--config", "tiny", "--max-tokens", "0", "hello"]) == 2
    assert "max_tokens: must be >= 1 (got 0)" in capsys.readouterr().err
    assert main(["generate", "--config", "tiny"]) == 2
    assert "needs at least one prompt" in capsys.readouterr().err
    bad = tmp_path / "in.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": []}\n')
    assert main(["generate", "--config", "tiny", "--input", str(bad)]) == 2
    assert f"{bad}:2: prompt: must not be empty (got [])" in capsys.readouterr().err
    bad.write_text('{"prompt": "ok", "max_tokens": -1}\n')
    assert main(["generate", "--config", "tiny", "--input", str(bad)]) == 2
    assert "max_tokens: must be >= 1 (got -1)" in capsys.readouterr().err
