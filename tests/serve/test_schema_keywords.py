"""Structured output refuses what its grammar cannot enforce: a JSON schema keyword
(``engine.structured_support``) or a regex feature is a 400 naming it by its path in the request,
before any worker runs; each unsupported case is paired with a check, on the grammar itself,
that it would have been ignored (an output breaking it is accepted)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from engine.structured_support import REFUSED_KEYWORDS, SCHEMA_KEYWORDS, unsupported_in_schema
from tests.serve.conftest import Server

ROOT = "response_format.json_schema.schema"
INTS = {"type": "array", "items": {"type": "integer"}}
PAIR = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

#: (schema, the keyword's path in it, an output that breaks the keyword) for ten keywords
UNSUPPORTED: list[tuple[dict[str, Any], str, object]] = [
    (
        {"type": "object", "properties": {"xs": {**INTS, "uniqueItems": True}}, "required": ["xs"]},
        "properties.xs.uniqueItems",
        {"xs": [1, 1]},
    ),
    ({"type": "string", "not": {"const": "red"}}, "not", "red"),
    ({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}, "pattern", "page"),
    (
        {"type": "object", "properties": {"xs": {**INTS, "contains": {"const": 3}}}, "required": ["xs"]},
        "properties.xs.contains",
        {"xs": [1]},
    ),
    ({**PAIR, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, "if", {"a": 1}),
    ({**PAIR, "dependentRequired": {"a": ["b"]}}, "dependentRequired", {"a": 1}),
    ({"anyOf": [{"type": "number", "multipleOf": 0.5}, {"type": "null"}]}, "anyOf.0.multipleOf", 1.3),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf", 1),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding", "!!"),
    (
        {
            "$defs": {"tag": {"type": "string", "format": "idn-email"}},
            "type": "array",
            "items": {"$ref": "#/$defs/tag"},
        },
        "$defs.tag.format",
        ["x"],
    ),
]


@pytest.mark.parametrize(("schema", "path", "breaking"), UNSUPPORTED, ids=[p for _, p, _ in UNSUPPORTED])
def test_an_unsupported_keyword_is_a_400_naming_its_path(
    server: Server, schema: dict[str, Any], path: str, breaking: object
) -> None:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    answer = server.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == f"{ROOT}.{path}", error
    assert error["message"].startswith(f"{ROOT}.{path}: ") and "not supported" in error["message"], error
    # the grammar alone would have admitted an output that breaks the keyword
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, json.dumps(breaking))


@pytest.mark.parametrize(
    ("field", "value", "feature"),
    [
        ("guided_regex", "^(?!x)[a-z]+$", "negative lookahead (?!"),
        ("guided_json", {"type": "string", "pattern": "(a)\\1"}, "backreference \\1"),
    ],
)
def test_an_unsupported_regex_feature_is_a_400_naming_it(
    server: Server, field: str, value: object, feature: str
) -> None:
    body = {"model": server.model, "prompt": "x", "max_tokens": 4, field: value}
    answer = server.post("/v1/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == (field if field == "guided_regex" else f"{field}.pattern")
    assert f"{feature} not supported" in error["message"], error


def test_supported_keywords_and_escaped_look_alikes_pass() -> None:
    schema = {
        "$defs": {"id": {"type": "integer", "minimum": 0, "multipleOf": 2}},
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[(?=]\\(?!x\\)\\\\1$", "maxLength": 8},
            "when": {"type": "string", "format": "date-time"},
            "ids": {"type": "array", "items": {"$ref": "#/$defs/id"}, "minItems": 1, "maxItems": 3},
            "pick": {"oneOf": [{"const": "a"}, {"enum": [1, 2]}]},
            "one": {"allOf": [{"type": "boolean"}]},
        },
        "required": ["code"],
        "additionalProperties": False,
        "title": "t",
        "description": "d",
    }
    assert unsupported_in_schema(schema) is None
    assert not SCHEMA_KEYWORDS & REFUSED_KEYWORDS
    assert all(unsupported_in_schema({keyword: {}}) is not None for keyword in REFUSED_KEYWORDS)
