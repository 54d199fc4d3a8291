"""JSONL input: every bad line becomes a LineError naming the field and the value (and keeping its
id when it had a usable one); the good lines around it still parse."""

from __future__ import annotations

import json
import math

import pytest

from cluster.jsonl import LineError, PromptItem, read_prompts
from engine.sampling_params import SamplingParams

DEFAULTS = SamplingParams(max_tokens=8)

BAD_LINES = [
    ('{"prompt": "x", "temperature": NaN}', "temperature: must be a finite number (got nan)"),
    ('{"prompt": "x", "temperature": Infinity}', "temperature: must be a finite number (got inf)"),
    ('{"prompt": "x", "top_p": -Infinity}', "top_p: must be a finite number (got -inf)"),
    ('{"prompt": "x", "temperature": "abc"}', "temperature: must be a number (got 'abc')"),
    ('{"prompt": "x", "temperature": -1}', "temperature: must be >= 0.0 (got -1)"),
    ('{"prompt": "x", "max_tokens": "5"}', "max_tokens: must be an integer (got '5')"),
    ('{"prompt": "x", "max_tokens": 5.0}', "max_tokens: must be an integer (got 5.0)"),
    ('{"prompt": "x", "max_tokens": true}', "max_tokens: must be an integer (got True)"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens: must be >= 1 (got 0)"),
    ('{"prompt": "x", "top_k": -2}', "top_k: must be >= 0 (got -2)"),
    ('{"prompt": "x", "top_p": 0}', "top_p: must be > 0.0 (got 0)"),
    ('{"prompt": "x", "seed": "7"}', "seed: must be an integer (got '7')"),
    ('{"prompt": "x", "stop": [""]}', "stop: stop strings must be non-empty (got [''])"),
    ('{"prompt": "x", "stop": 3}', "stop: must be a string or a list of strings (got 3)"),
    ('{"prompt": "x", "ignore_eos": "yes"}', "ignore_eos: must be true or false (got 'yes')"),
    ('{"prompt": null}', "prompt: must be text or a list of token ids (got None)"),
    ('{"prompt": 42}', "prompt: must be text or a list of token ids (got 42)"),
    ('{"prompt": ""}', "prompt: must not be empty (got '')"),
    ('{"prompt": []}', "prompt: must not be empty (got [])"),
    ('{"prompt": [1, "2"]}', "prompt: token id '2' is not an integer (position 1 of 2)"),
    ('{"prompt": [1, -2]}', "prompt: token id -2 is negative (position 1 of 2)"),
    ('{"text": "no prompt"}', "text: unknown field (got 'no prompt')"),
    ('{"seed": 1}', "prompt: required field is missing"),
    ('{"prompt": "x", "max_token": 5}', "max_token: unknown field (got 5)"),
    ('{"prompt": "x", "id": [1]}', "id: must be a string or an integer (got [1])"),
    ('{"prompt": "x", "cache_salt": ""}', "cache_salt: must be a non-empty string (got '')"),
    ('{"prompt": "x", "cache_salt": 7}', "cache_salt: must be a non-empty string (got 7)"),
    ('["prompt", "x"]', "line: must be a JSON object with a \"prompt\" field (got ['prompt', 'x'])"),
    ('{"prompt": "x",', "line: not valid JSON (Expecting property name enclosed in double quotes at column 16)"),
]


@pytest.mark.parametrize("line,message", BAD_LINES, ids=[line for line, _ in BAD_LINES])
def test_a_bad_line_is_named_and_the_good_lines_still_parse(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(f'{{"prompt": "first", "id": 1}}\n{line}\n\n{{"prompt": [5, 6], "max_tokens": 2}}\n')
    first, bad, last = read_prompts(path, DEFAULTS)
    assert first == PromptItem("first", DEFAULTS, "1", str(path), 1)
    assert isinstance(bad, LineError)
    assert str(bad) == f"{path}:2: {message}"
    assert bad.record() == {"line": 2, "error": message}
    assert last == PromptItem([5, 6], DEFAULTS.replace(max_tokens=2), None, str(path), 4)  # blank line 3 skipped


def test_a_line_carries_its_cache_salt(tmp_path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "x", "cache_salt": "tenant-a"}\n{"prompt": "x"}\n')
    salted, plain = read_prompts(path, DEFAULTS)
    assert salted == PromptItem("x", DEFAULTS, None, str(path), 1, "tenant-a")
    assert plain == PromptItem("x", DEFAULTS, None, str(path), 2, None)


def test_a_line_carries_its_structured_output_and_a_bad_spec_is_named(tmp_path) -> None:
    from engine.sampling_params import StructuredOutput

    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"prompt": "x", "structured": {"kind": "regex", "spec": "[ab]+"}}\n'
        '{"prompt": "x", "structured": {"kind": "json_schema", "spec": "{\\"type\\": \\"nope\\"}"}}\n'
    )
    constrained, bad = read_prompts(path, DEFAULTS)
    assert isinstance(constrained, PromptItem)
    assert constrained.sampling.structured == StructuredOutput(kind="regex", spec="[ab]+")
    assert isinstance(bad, LineError)
    assert str(bad).startswith(f"{path}:2: structured.spec: not a valid json_schema") and "nope" in str(bad)


def test_an_error_record_keeps_the_lines_id(tmp_path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "q7", "prompt": "x", "temperature": NaN}\n{"id": 3, "prompt": null}\n')
    records = [entry.record() for entry in read_prompts(path, DEFAULTS)]
    assert records == [
        {"id": "q7", "line": 1, "error": "temperature: must be a finite number (got nan)"},
        {"id": "3", "line": 2, "error": "prompt: must be text or a list of token ids (got None)"},
    ]
    json.dumps(records, allow_nan=False)  # an error record is plain JSON even when the value was NaN


def test_several_bad_fields_on_one_line_are_all_named(tmp_path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "x", "max_tokens": 0, "temperature": NaN}\n')
    (bad,) = read_prompts(path, DEFAULTS)
    assert bad.message == "max_tokens: must be >= 1 (got 0); temperature: must be a finite number (got nan)"


def test_a_line_that_is_not_utf8_is_one_bad_line(tmp_path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "\xff"}\n{"prompt": "ok"}\n')
    bad, good = read_prompts(path, DEFAULTS)
    assert isinstance(bad, LineError) and bad.message.startswith("line: not valid UTF-8")
    assert isinstance(good, PromptItem) and good.prompt == "ok"


def test_line_fields_override_the_defaults(tmp_path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "x", "temperature": 0.5, "seed": 3, "stop": "\\n", "ignore_eos": true, "top_k": 4}\n')
    (item,) = read_prompts(path, DEFAULTS)
    assert item.sampling == SamplingParams(
        max_tokens=8, temperature=0.5, seed=3, stop=("\n",), ignore_eos=True, top_k=4
    )
    assert not math.isnan(item.sampling.temperature)


def test_an_unreadable_file_raises(tmp_path) -> None:
    with pytest.raises(OSError):
        read_prompts(tmp_path / "missing.jsonl", DEFAULTS)
