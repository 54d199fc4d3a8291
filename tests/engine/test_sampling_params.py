"""SamplingParams as the edge's strict validator: every field refuses wrong types, NaN,
infinities and out-of-range values with one field-named line, and keeps the semantics the rest
of the code relies on (defaults, equality and hashing without ``extra``, pickling, frozen)."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys

import pytest

from engine.sampling_params import MIN_TEMPERATURE, SamplingParams
from engine.validation import InvalidRequestError, check_prompt, check_token_ids, prompt_batch

NAN, INF = math.nan, math.inf
WRONG_TYPE_FLOAT = ["abc", "0.5", None, True, [0.5], {"v": 1}]
WRONG_TYPE_INT = ["5", 5.0, 2.5, True, None, [5]]
NOT_FINITE = [NAN, INF, -INF]

BAD = [
    *[("temperature", v, "must be a number") for v in WRONG_TYPE_FLOAT],
    *[("temperature", v, "must be a finite number") for v in NOT_FINITE],
    ("temperature", -0.5, "must be >= 0"),
    ("temperature", 1e-9, f"must be 0 (greedy) or >= {MIN_TEMPERATURE}"),
    ("temperature", 1e-300, f"must be 0 (greedy) or >= {MIN_TEMPERATURE}"),
    *[("top_p", v, "must be a number") for v in WRONG_TYPE_FLOAT],
    *[("top_p", v, "must be a finite number") for v in NOT_FINITE],
    ("top_p", 0.0, "must be > 0"),
    ("top_p", -0.1, "must be > 0"),
    ("top_p", 1.5, "must be <= 1"),
    *[("max_tokens", v, "must be an integer") for v in WRONG_TYPE_INT],
    *[("max_tokens", v, "must be an integer") for v in NOT_FINITE],
    ("max_tokens", 0, "must be >= 1"),
    ("max_tokens", -3, "must be >= 1"),
    *[("top_k", v, "must be an integer") for v in WRONG_TYPE_INT],
    *[("top_k", v, "must be an integer") for v in NOT_FINITE],
    ("top_k", -1, "must be >= 0"),
    *[("seed", v, "must be an integer") for v in ["5", 5.0, True, [5], NAN, INF]],
    ("seed", 2**64, "must fit in 64 bits"),
    ("seed", -(2**63) - 1, "must fit in 64 bits"),
    ("stop", 5, "must be a string or a list of strings"),
    ("stop", None, "must be a string or a list of strings"),
    ("stop", "", "stop strings must be non-empty"),
    ("stop", ["ok", ""], "stop strings must be non-empty"),
    ("stop_token_ids", 5, "must be a list of token ids"),
    ("stop_token_ids", "12", "must be a list of token ids"),
    ("ignore_eos", 1, "must be true or false"),
    ("ignore_eos", "true", "must be true or false"),
    ("ignore_eos", None, "must be true or false"),
    ("include_stop_str_in_output", 0, "must be true or false"),
    ("extra", [], "must be a mapping"),
]


@pytest.mark.parametrize("field,value,message", BAD, ids=lambda v: repr(v)[:30])
def test_every_bad_field_is_named_with_its_value(field: str, value, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(**{field: value})
    text = str(caught.value)
    assert isinstance(caught.value, InvalidRequestError)
    assert text.startswith(f"{field}: {message}"), text
    assert "\n" not in text  # one problem, one line
    assert text.endswith(f"(got {value!r})"), text


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("stop", [1], "stop[0]: must be a string (got 1)"),
        ("stop", ["a", None], "stop[1]: must be a string (got None)"),
        ("stop_token_ids", [3, -1], "stop_token_ids[1]: must be >= 0 (got -1)"),
        ("stop_token_ids", ["a"], "stop_token_ids[0]: must be an integer (got 'a')"),
        ("stop_token_ids", [1.0], "stop_token_ids[0]: must be an integer (got 1.0)"),
        ("stop_token_ids", [True], "stop_token_ids[0]: must be an integer (got True)"),
    ],
)
def test_list_items_are_named_by_position(field: str, value, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(**{field: value})
    assert str(caught.value) == message


def test_the_messages_of_the_issue() -> None:
    cases = {
        "temperature: must be a finite number (got nan)": {"temperature": NAN},
        "temperature: must be a number (got 'abc')": {"temperature": "abc"},
        "max_tokens: must be an integer (got '5')": {"max_tokens": "5"},
        "top_p: must be a finite number (got inf)": {"top_p": INF},
        "tempreature: unknown field (got 0.5)": {"tempreature": 0.5},
    }
    for message, fields in cases.items():
        with pytest.raises(ValueError) as caught:
            SamplingParams(**fields)
        assert str(caught.value) == message


def test_several_bad_fields_give_one_line_each() -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(temperature=NAN, max_tokens=0)
    assert caught.value.problems == [  # type: ignore[attr-defined]
        "max_tokens: must be >= 1 (got 0)",
        "temperature: must be a finite number (got nan)",
    ]


def test_good_values_and_defaults() -> None:
    default = SamplingParams()
    assert (default.max_tokens, default.temperature, default.top_k, default.top_p, default.seed) == (
        16,
        0.0,
        0,
        1.0,
        None,
    )
    assert default.stop == () and default.stop_token_ids == () and default.greedy
    assert not default.ignore_eos and not default.include_stop_str_in_output and default.extra == {}
    sp = SamplingParams(
        max_tokens=1,
        temperature=2,
        top_k=50,
        top_p=1,
        seed=-(2**63),
        stop=["a", "b"],
        stop_token_ids=[0, 7],
        ignore_eos=True,
        include_stop_str_in_output=True,
    )
    assert sp.temperature == 2.0 and isinstance(sp.temperature, float) and not sp.greedy
    assert sp.stop == ("a", "b") and sp.stop_token_ids == (0, 7)
    assert SamplingParams(stop="###").stop == ("###",)  # one string is one stop string
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_equality_and_hash_ignore_extra_and_normalize_lists() -> None:
    a = SamplingParams(max_tokens=3, stop=["x"], extra={"trace": 1})
    b = SamplingParams(max_tokens=3, stop=("x",))
    assert a == b and hash(a) == hash(b) and {a: "v"}[b] == "v"
    assert a != SamplingParams(max_tokens=4, stop=("x",))
    assert a != "not sampling params"


def test_frozen_picklable_and_replace_validates() -> None:
    sp = SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop=("\n",), extra={"k": "v"})
    with pytest.raises(ValueError):
        sp.max_tokens = 6  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(sp))
    assert again == sp and again.extra == {"k": "v"} and again.stop == ("\n",)
    assert sp.replace(max_tokens=9).max_tokens == 9 and sp.replace(max_tokens=9).seed == 3
    with pytest.raises(ValueError, match=r"^temperature: must be a finite number \(got inf\)$"):
        sp.replace(temperature=INF)


def test_coerce_takes_none_a_dict_or_an_instance() -> None:
    sp = SamplingParams(max_tokens=2)
    assert SamplingParams.coerce(None) == SamplingParams()
    assert SamplingParams.coerce(sp) is sp
    assert SamplingParams.coerce({"max_tokens": 2}) == sp
    with pytest.raises(ValueError, match=r"^temperature: must be a finite number \(got nan\)$"):
        SamplingParams.coerce({"temperature": NAN})
    for bad in (["max_tokens", 2], "greedy", 3, {1: 2}):
        with pytest.raises(ValueError, match=r"^sampling: must be SamplingParams or a dict of its fields \(got "):
            SamplingParams.coerce(bad)


@pytest.mark.parametrize(
    "prompt,message",
    [
        (None, "prompt: must be text or a list of token ids (got None)"),
        (5, "prompt: must be text or a list of token ids (got 5)"),
        ({"text": "hi"}, "prompt: must be text or a list of token ids (got {'text': 'hi'})"),
        ("", "prompt: must not be empty (got '')"),
        ([], "prompt: must not be empty (got [])"),
        ([1, "a"], "prompt: token id 'a' is not an integer (position 1 of 2)"),
        ([1, 2.0], "prompt: token id 2.0 is not an integer (position 1 of 2)"),
        ([True], "prompt: token id True is not an integer (position 0 of 1)"),
        ([3, -1], "prompt: token id -1 is negative (position 1 of 2)"),
    ],
)
def test_prompt_shape_errors_name_the_prompt(prompt, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_prompt(prompt)
    assert str(caught.value) == message


def test_token_ids_against_a_vocabulary() -> None:
    assert check_token_ids((0, 255), 256) == [0, 255]
    with pytest.raises(ValueError, match=r"^prompt: token id 256 is outside the vocabulary \[0, 256\) \(position 1"):
        check_token_ids([1, 256], 256)
    with pytest.raises(ValueError, match=r"^prompt: token id -1 is outside the vocabulary \[0, 256\)"):
        check_token_ids([-1], 256)


def test_long_values_are_cut_in_messages() -> None:
    with pytest.raises(ValueError) as caught:
        check_prompt({"x": list(range(10_000))})
    assert len(str(caught.value)) < 200 and str(caught.value).endswith("...)")


def test_prompt_batch_tells_one_prompt_from_many() -> None:
    assert prompt_batch("a") == ["a"]
    assert prompt_batch([1, 2]) == [[1, 2]]
    assert prompt_batch([1, "a"]) == [[1, "a"]]  # a token list with a bad id: one bad prompt
    assert prompt_batch(["a", [1]]) == ["a", [1]]
    assert prompt_batch([]) == []
    assert prompt_batch(None) == [None]


def test_the_module_imports_neither_torch_nor_ray() -> None:
    code = "import sys, engine.sampling_params; sys.exit(bool({'torch', 'ray'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0
