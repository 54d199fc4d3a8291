"""OpenAI-compatible request bodies, validated at the edge.

Every body is a pydantic model in strict mode: a string where a number belongs, a float where an
integer belongs, NaN and infinities are all refused, and so is any field OpenAI's API does not
define (or kvfleet's documented extensions ``top_k``, ``ignore_eos`` and ``cache_salt``). Fields kvfleet does not
implement (``n > 1``, ``logprobs``, ``echo``, ``best_of > 1``, penalties, ...) are accepted
only at their neutral value; anything else is a 400 naming the field. ``describe`` turns a
pydantic error into ``(param, message)`` with the field path and the value.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from configs.load import VALIDATION_MESSAGES
from engine.sampling_params import SamplingParams
from engine.validation import InvalidRequestError, check_cache_salt
from serving.tools import (
    ToolCall,
    ToolCalling,
    ToolChoice,
    ToolDefinition,
    ToolFieldError,
    check_message_fields,
    check_tool_fields,
    template_message,
)

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
PromptItem = str | list[int]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """The sampling fields /v1/completions and /v1/chat/completions share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[FiniteFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[FiniteFloat, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM's extension: -1 or 0 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1)] = 1
    presence_penalty: FiniteFloat = 0.0
    frequency_penalty: FiniteFloat = 0.0
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's extension: prompts share cached blocks only with the same salt

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else (stop or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings (got {len(strings)})")
        if any(not s for s in strings):
            raise ValueError(f"stop strings must be non-empty (got {stop!r})")
        return stop

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, cache_salt: str | None) -> str | None:
        try:
            return check_cache_salt(cache_salt)
        except InvalidRequestError as exc:  # ``describe`` puts the field name in front itself
            raise ValueError(str(exc).removeprefix("cache_salt: ")) from None

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, seed: int | None) -> int | None:
        if seed is not None and not -(2**63) <= seed < 2**64:
            raise ValueError(f"must fit in 64 bits (got {seed})")
        return seed

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        _neutral(self, "n", 1, "only n=1 is supported; send the request n times")
        _neutral(self, "presence_penalty", 0.0, "penalties are not supported")
        _neutral(self, "frequency_penalty", 0.0, "penalties are not supported")
        if self.logit_bias:
            raise _field_error("logit_bias", "is not supported", self.logit_bias)
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "is only allowed with stream=true", self.stream_options.model_dump())
        return self

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters (OpenAI's defaults: temperature 1, top_p 1)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            seed=None if self.seed is None else self.seed % 2**63,
            stop=stop,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: Any
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> list[PromptItem]:
        return normalize_prompt(prompt)

    @model_validator(mode="after")
    def _unsupported_completion(self) -> CompletionRequest:
        _neutral(self, "echo", False, "echo is not supported")
        _neutral(self, "logprobs", None, "logprobs are not supported")
        if self.best_of not in (None, 1):
            raise _field_error("best_of", "only best_of=1 is supported", self.best_of)
        _neutral(self, "suffix", None, "suffix is not supported")
        return self

    @property
    def prompts(self) -> list[PromptItem]:
        return list(self.prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One history message; ``ChatCompletionRequest`` checks the tool fields (``serving.tools``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        return template_message(self.role, self.text, self.name, self.tool_calls, self.tool_call_id)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unsupported_chat(self) -> ChatCompletionRequest:
        _neutral(self, "logprobs", False, "logprobs are not supported")
        _neutral(self, "top_logprobs", None, "logprobs are not supported")
        try:
            check_tool_fields(self.tools, self.tool_choice)
            for i, m in enumerate(self.messages):
                check_message_fields(i, m.role, m.content is not None, m.tool_calls, m.tool_call_id)
        except ToolFieldError as exc:
            raise _field_error(exc.param, exc.message, exc.value) from None
        if self.response_format not in (None, {"type": "text"}):
            raise _field_error("response_format", "only {'type': 'text'} is supported", self.response_format)
        if self.max_completion_tokens is not None and self.max_tokens not in (None, self.max_completion_tokens):
            raise _field_error(
                "max_completion_tokens",
                f"differs from max_tokens ({self.max_tokens}); send one of them",
                self.max_completion_tokens,
            )
        return self

    @property
    def tool_calling(self) -> ToolCalling | None:
        return ToolCalling.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class PinRequest(_Body):
    """``POST /v1/pins``: keep a prefix (text or token ids) resident on ``replicas`` workers."""

    prefix: Any
    replicas: Annotated[int, Field(ge=1)] = 1
    ttl: Annotated[FiniteFloat, Field(gt=0.0)] | None = None

    @field_validator("prefix", mode="before")
    @classmethod
    def _prefix_shape(cls, prefix: Any) -> PromptItem:
        items = normalize_prompt(prefix)
        if len(items) != 1:
            raise ValueError(f"must be one text or one list of token ids (got {len(items)} prompts)")
        return items[0]


def normalize_prompt(prompt: Any) -> list[PromptItem]:
    """A prompt field as a list of prompts, each text or token ids; ValueError if malformed (the
    message leaves the field's name to ``describe`` and names the item only in a batch)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    elif isinstance(prompt, list):
        raise ValueError("must not be empty (got [])")
    else:
        raise ValueError(f"must be a string, a list of token ids, or a list of either (got {_kind(prompt)})")
    if len(items) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per request (got {len(items)})")
    out: list[PromptItem] = []
    for i, item in enumerate(items):
        item_of_batch = f"item {i} " if len(items) > 1 else ""
        if isinstance(item, str):
            if not item:
                raise ValueError(f"{item_of_batch}must not be empty (got '')")
            out.append(item)
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            out.append(list(item))
        elif isinstance(item, list) and not item:
            raise ValueError(f"{item_of_batch}must not be empty (got [])")
        elif isinstance(item, list):
            bad = next(t for t in item if not _is_token(t))
            raise ValueError(f"{item_of_batch}must hold token ids, non-negative integers (got {bad!r})")
        else:
            raise ValueError(f"{item_of_batch}must be a string or a list of token ids (got {_kind(item)})")
    return out


def describe(error: ValidationError) -> tuple[str, str]:
    """The first problem of a failed body validation as (param, "param: message (got value)")."""
    first = error.errors(include_url=False)[0]
    ctx = first.get("ctx") or {}
    if "kvfleet_field" in ctx:
        param, message, value = ctx["kvfleet_field"], ctx["message"], ctx["value"]
    else:
        param = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p)) or "body"
        message = _message(first)
        value = first.get("input")
    if first["type"] == "missing":
        return param, f"{param}: required field is missing"
    if "(got " in message:  # the validator named the value itself
        return param, f"{param}: {message}"
    return param, f"{param}: {message} (got {_short(value)})"


# ---------------------------------------------------------------------------------------------


def _neutral(body: BaseModel, name: str, neutral: Any, why: str) -> None:
    value = getattr(body, name)
    if value != neutral:
        raise _field_error(name, why, value)


def _field_error(param: str, message: str, value: Any) -> Exception:
    from pydantic_core import PydanticCustomError

    context = {"kvfleet_field": param, "message": message, "value": value, "param": param}
    return PydanticCustomError("kvfleet_field", "{param}: {message}", context)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return type(value).__name__ + (f" {value!r}" if isinstance(value, (int, float, bool)) else "")


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"}
                                      or part.startswith("function-"))  # fmt: skip


_MESSAGES = {
    **VALIDATION_MESSAGES,
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "too_short": "must not be empty",
}


def _message(error: Any) -> str:
    ctx = error.get("ctx") or {}
    template = _MESSAGES.get(error["type"])
    if template is not None:
        try:
            return template.format(**ctx)
        except KeyError:
            return template
    return str(error["msg"]).removeprefix("Value error, ")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
