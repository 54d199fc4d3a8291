"""README's quick start: exactly two commands, and the CLI call in the first one parses; the
``Cluster`` calls it names exist."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

from cluster import Cluster
from cluster.api import Delta
from kvfleet.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def _quick_start_commands() -> list[str]:
    return [line for line in README.read_text().splitlines() if line.startswith("python3 -m venv ")]


def test_quick_start_is_two_commands() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2
    assert all("pip install torch==2.13.0" in c for c in commands)
    assert commands[1].endswith("python -m pytest -q tests")


def test_first_command_runs_a_real_subcommand() -> None:
    last_step = _quick_start_commands()[0].split("&&")[-1]
    argv = shlex.split(last_step)
    assert argv[0] == "kvfleet"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "generate" and args.prompts


def test_every_cluster_call_it_names_exists() -> None:
    """``cluster.<name>(`` in the README names a method of ``Cluster``; ``Delta`` has the fields
    the README gives it."""
    called = set(re.findall(r"\bcluster\.([a-z_]+)\(", README.read_text()))
    assert {"stream", "stream_completion", "generate", "abort"} <= called
    assert not [name for name in called if not callable(getattr(Cluster, name, None))]
    assert {f.name for f in dataclasses.fields(Delta)} == {"text", "num_tokens", "token_ids", "logprobs"}
