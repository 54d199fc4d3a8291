"""A structured-output spec (``engine.sampling_params.StructuredOutput``) as a grammar:
``grammar_of`` turns a spec into an ``xgrammar.Grammar`` (no tokenizer needed) and
``validate_structured`` is the entry points' one check of a spec. No torch here, so the drivers
and the HTTP ingress check specs without loading it; ``engine.structured_output`` compiles the
grammar against a model's vocabulary and applies it while sampling.

JSON (``json_object``, ``json_schema``) is generated compact (``", "`` and ``": "`` between
items, no other whitespace): a model never wanders into runs of blanks, and every output that
ends ends with its last closing bracket.

A JSON schema keyword or regex feature the grammar cannot enforce is refused, not ignored
(``engine.structured_support``): a schema is accepted only when every output the grammar admits
validates against it.
"""

from __future__ import annotations

import json
import re
from types import ModuleType
from typing import TYPE_CHECKING

from engine.sampling_params import StructuredOutput
from engine.structured_support import unsupported_in_regex, unsupported_in_schema
from engine.validation import InvalidRequestError, problem

if TYPE_CHECKING:
    import xgrammar

#: the location prefix of xgrammar's messages, e.g. ``[01:28:48] /project/cpp/regex_converter.cc:83: ``
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: \(.*?\) is false: )?")


def _native_message(exc: Exception) -> str:
    """xgrammar's error without its source location: what is wrong with the spec."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _NATIVE_PREFIX.sub("", text)


def _choices(spec: str) -> list[str]:
    """A ``choice`` spec: a JSON list of one or more strings (ValueError otherwise)."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON list of strings ({exc.msg})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("must be a JSON list of one or more non-empty strings")
    return choices


def _json_schema_text(spec: str) -> str:
    """A ``json_schema`` spec as the JSON text xgrammar converts: a JSON object whose every
    keyword the grammar enforces (ValueError otherwise, ``unsupported_in_schema``), with every
    length-bounded string written as a pattern (``_length_as_pattern``)."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON Schema as JSON text ({exc.msg})") from None
    if not isinstance(schema, dict):
        raise ValueError("must be a JSON Schema object")  # noqa: TRY004 - a bad spec is a ValueError (grammar_of)
    if (unsupported := unsupported_in_schema(schema)) is not None:
        path, why, _ = unsupported
        raise ValueError(f"{path}: {why}")
    return json.dumps(_length_as_pattern(schema))


def _length_as_pattern(schema: object) -> object:
    """``schema`` with each string schema bounded by ``minLength`` / ``maxLength`` alone (no
    ``pattern``, ``format``, ``enum`` or ``const``) bounded by the same-length pattern
    ``^[\\s\\S]{min,max}$`` instead: xgrammar 0.2.8 writes a length-bounded string as a bare
    character class that admits raw control characters, which JSON forbids in a string, while
    its pattern strings are JSON-aware. The two bounds are the same constraint: a pattern
    counts the characters of the decoded string, as the lengths do."""
    if isinstance(schema, list):
        return [_length_as_pattern(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _length_as_pattern(value) for key, value in schema.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    low, high = out.get("minLength", 0), out.get("maxLength")
    bounds_only = not any(key in out for key in ("pattern", "format", "enum", "const"))
    bounded = "minLength" in out or "maxLength" in out
    if is_string and bounds_only and bounded and isinstance(low, int) and isinstance(high, (int, type(None))):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^[\\s\\S]{{{low},{'' if high is None else high}}}$"
    return out


def load_xgrammar() -> ModuleType:
    """The xgrammar module, imported on first use: it imports transformers (about a second), so
    a process that never sees a constrained request (the driver, the ingress, an engine serving
    plain requests) never pays that. Every user of xgrammar takes it from here."""
    import xgrammar

    return xgrammar


def grammar_of(structured: StructuredOutput) -> xgrammar.Grammar:
    """The grammar a spec stands for (the one place each kind's rule lives). Raises ValueError
    saying what is wrong with ``structured.spec``."""
    xgrammar = load_xgrammar()

    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json_object":
            if spec.strip():
                raise ValueError("must be empty for json_object (any JSON object)")
            # strict_mode=False: an object schema without properties admits any members
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "json_schema":
            return xgrammar.Grammar.from_json_schema(_json_schema_text(spec), any_whitespace=False)
        if kind == "regex":
            if not spec:
                raise ValueError("must be a non-empty regular expression")
            if (feature := unsupported_in_regex(spec)) is not None:
                raise ValueError(f"{feature} not supported")
            return xgrammar.Grammar.from_regex(spec)
        if kind == "grammar":
            if not spec.strip():
                raise ValueError("must be a non-empty EBNF grammar (root rule: root)")
            return xgrammar.Grammar.from_ebnf(spec)
        # choice: one rule, an alternative per string (JSON string escapes are EBNF's too)
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=True) for choice in _choices(spec))
        return xgrammar.Grammar.from_ebnf(f"root ::= {alternatives}")
    except RuntimeError as exc:  # xgrammar's parsers and converters raise RuntimeError
        raise ValueError(_native_message(exc)) from None


def validate_structured(structured: object, field: str = "structured") -> StructuredOutput | None:
    """The entry points' one check of a structured-output spec: None, or a StructuredOutput
    whose spec makes a grammar (a schema that converts, a regex that parses, a grammar with a
    ``root`` rule, a non-empty list of choices). Raises InvalidRequestError naming
    ``<field>.spec`` and the value, e.g. ``structured.spec: Unsupported type "nope" (got ...)``."""
    if structured is None:
        return None
    if not isinstance(structured, StructuredOutput):
        raise InvalidRequestError(problem(field, "must be a StructuredOutput", structured))
    try:
        grammar_of(structured)
    except ValueError as exc:
        message = f"not a valid {structured.kind}: {exc}"
        raise InvalidRequestError(problem(f"{field}.spec", message, structured.spec)) from None
    return structured
