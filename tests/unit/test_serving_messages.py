"""The HTTP API's body checks without a server: each malformed prompt gets one message that names
the field once, says what is wrong and shows the value (``serving.protocol.describe``)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from serving.protocol import CompletionRequest, PinRequest, describe


def _message(model: type[CompletionRequest | PinRequest], body: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return describe(caught.value)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt: must not be empty (got '')"),
        ([], "prompt: must not be empty (got [])"),
        ([[]], "prompt: must not be empty (got [])"),
        ([1, 2, -3], "prompt: must hold token ids, non-negative integers (got -3)"),
        (["fine", ""], "prompt: item 1 must not be empty (got '')"),
        (["fine", [4, "x"]], "prompt: item 1 must hold token ids, non-negative integers (got 'x')"),
        (["fine", 3.5], "prompt: item 1 must be a string or a list of token ids (got float 3.5)"),
    ],
)
def test_a_bad_prompt_is_named_once_with_its_value(prompt: Any, message: str) -> None:
    assert _message(CompletionRequest, {"model": "m", "prompt": prompt}) == ("prompt", message)


def test_a_pin_prefix_is_named_as_prefix() -> None:
    assert _message(PinRequest, {"prefix": ""}) == ("prefix", "prefix: must not be empty (got '')")
