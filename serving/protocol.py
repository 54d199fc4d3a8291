"""OpenAI-compatible request bodies, validated at the edge.

Every body is a pydantic model in strict mode: a string where a number belongs, a float where an
integer belongs, NaN and infinities are all refused, and so is any field OpenAI's API does not
define (or one of vLLM's extensions kvfleet documents: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``cache_salt``, ``guided_*`` and ``structured_outputs``).
Fields kvfleet does not implement (``suffix``) are accepted only at their neutral
value; anything else is a 400 naming the field. ``describe`` turns a pydantic error into
``(param, message)`` with the field path and the value.

The structured-output fields (``response_format``, ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, ``structured_outputs``) are checked for their shape here
and become one ``StructuredOutput``; at most one of them may constrain a request. A schema
keyword or regex feature the grammar cannot enforce is a 400 naming it by its path
(``response_format.json_schema.schema.properties.xs.uniqueItems: not supported``,
``engine.structured_support``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from configs.load import VALIDATION_MESSAGES
from engine.kv_cache.coordinator_types import PinTier
from engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, StructuredOutput
from engine.structured_support import unsupported_in_regex, unsupported_in_schema
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
MAX_SAMPLES = 128  # the most samples (``n``, ``best_of``) per prompt, OpenAI's bound on ``n``
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value (either sign)
#: the fields that constrain the output, in the order a conflict between two is reported
STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
#: OpenAI's rule for ``response_format.json_schema.name``
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
PromptItem = str | list[int]
# The JSON schema of a prompt field (``/openapi.json``): the field is ``Any`` and its validator
# (``normalize_prompt``) does the checking, so the schema is spelled out here.
_TEXT_SCHEMA = {"type": "string", "minLength": 1}
_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
ONE_PROMPT_SCHEMA: dict[str, Any] = {"anyOf": [_TEXT_SCHEMA, _TOKEN_IDS_SCHEMA]}
PROMPTS_SCHEMA: dict[str, Any] = {
    "anyOf": [
        *ONE_PROMPT_SCHEMA["anyOf"],
        {
            "type": "array",
            "items": {"anyOf": [_TEXT_SCHEMA, _TOKEN_IDS_SCHEMA]},
            "minItems": 1,
            "maxItems": MAX_PROMPTS,
        },
    ]
}


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
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 1
    presence_penalty: Annotated[FiniteFloat, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[FiniteFloat, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[FiniteFloat, Field(gt=0.0, le=10.0)] | None = None  # vLLM's: > 1 penalises
    min_p: Annotated[FiniteFloat, Field(ge=0.0, le=1.0)] | None = None  # vLLM's extension
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's extension: prompts share cached blocks only with the same salt
    response_format: dict[str, Any] | None = None
    guided_json: Any = None  # vLLM's extensions from here on: one of them, or response_format, at a time
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

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

    @field_validator("logit_bias")
    @classmethod
    def _bias_entries(cls, bias: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids as strings of digits (got {key!r})")
            if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"bias of token {key} must be a number in [-100, 100] (got {_short(value)})")
        return bias

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "is only allowed with stream=true", self.stream_options.model_dump())
        self.structured()  # every structured-output field's shape, once, here
        return self

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters for one sample (OpenAI's defaults: temperature 1,
        top_p 1, no penalties); ``logprobs`` and ``prompt_logprobs`` come from the endpoint."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            seed=None if self.seed is None else self.seed % 2**63,
            stop=stop,
            ignore_eos=self.ignore_eos,
            logprobs=self.output_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
            min_p=self.min_p or 0.0,
            structured=self.structured(),
        )

    @property
    def output_logprobs(self) -> int | None:
        """Top logprobs per output token the client asked to see (None: no logprobs)."""
        return None

    @property
    def prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token the client asked to see (None: none)."""
        return None

    @property
    def samples_per_prompt(self) -> int:
        """How many samples run per prompt (``best_of`` where it is larger than ``n``)."""
        return self.n

    def structured(self) -> StructuredOutput | None:
        """The one output constraint the body asks for; ValueError-like pydantic errors naming the
        field (the first field set wins the name when two are set)."""
        given = [
            name
            for name in STRUCTURED_FIELDS
            if getattr(self, name) is not None and getattr(self, name) != {"type": "text"}
        ]
        if len(given) > 1:
            raise _field_error(
                given[1], f"only one structured-output field at a time (also got {given[0]})", getattr(self, given[1])
            )
        if not given:
            return None
        name = given[0]
        value = getattr(self, name)
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value)
        kind = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
        return _constraint(name, kind[name], value)

    @property
    def structured_param(self) -> str:
        """The field that holds the structured-output spec (for errors in the spec itself)."""
        name = next((n for n in STRUCTURED_FIELDS if getattr(self, n) not in (None, {"type": "text"})), "")
        if name == "response_format" and self.response_format is not None:
            return "response_format.json_schema.schema" if self.response_format.get("type") == "json_schema" else name
        if name == "structured_outputs" and self.structured_outputs is not None:
            key = next((k for k, v in self.structured_outputs.items() if v is not None), "")
            return f"{name}.{key}"
        return name

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: Annotated[Any, Field(json_schema_extra=PROMPTS_SCHEMA)]
    # 0 with ``echo``: the prompt is scored (its logprobs with ``logprobs``) and nothing generated
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> list[PromptItem]:
        return normalize_prompt(prompt)

    @model_validator(mode="after")
    def _unsupported_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise _field_error("best_of", f"must be >= n ({self.n})", self.best_of)
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise _field_error("best_of", f"best_of > n ({self.n}) cannot be streamed", self.best_of)
        _neutral(self, "suffix", None, "suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise _field_error("max_tokens", "must be >= 1 unless echo is true (0 with echo scores the prompt)", 0)
        return self

    @property
    def prompts(self) -> list[PromptItem]:
        return list(self.prompt)

    @property
    def output_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def samples_per_prompt(self) -> int:
        return max(self.n, self.best_of or 1)

    @property
    def score_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the prompt (and its logprobs) alone, nothing generated."""
        return self.max_tokens == 0


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
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _unsupported_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _field_error("top_logprobs", "needs logprobs=true", self.top_logprobs)
        try:
            check_tool_fields(self.tools, self.tool_choice)
            for i, m in enumerate(self.messages):
                check_message_fields(i, m.role, m.content is not None, m.tool_calls, m.tool_call_id)
        except ToolFieldError as exc:
            raise _field_error(exc.param, exc.message, exc.value) from None
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

    @property
    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class PinRequest(_Body):
    """``POST /v1/pins``: keep a prefix (text or token ids) resident on ``replicas`` workers, in
    device memory or in the host tier only (``tier``, ``Cluster.pin_prefix``)."""

    prefix: Annotated[Any, Field(json_schema_extra=ONE_PROMPT_SCHEMA)]
    replicas: Annotated[int, Field(ge=1)] = 1
    ttl: Annotated[FiniteFloat, Field(gt=0.0)] | None = None
    tier: PinTier = "device"

    @field_validator("prefix", mode="before")
    @classmethod
    def _prefix_shape(cls, prefix: Any) -> PromptItem:
        items = normalize_prompt(prefix)
        if len(items) != 1:
            raise ValueError(f"must be one text or one list of token ids (got {len(items)} prompts)")
        return items[0]


class TokenizeCompletionRequest(_Body):
    """``POST /tokenize`` with a text (vLLM's shape): its token ids, with the tokenizer's special
    tokens (a BOS) unless ``add_special_tokens`` is false."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    """``POST /tokenize`` with chat messages (vLLM's shape): the ids the chat template gives, as
    ``/v1/chat/completions`` would run them. kvfleet renders with the model's own template only:
    ``chat_template``, ``chat_template_kwargs``, ``continue_final_message``, ``mm_processor_kwargs``
    and ``add_special_tokens`` are accepted at their neutral values."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None

    @model_validator(mode="after")
    def _neutral_fields(self) -> TokenizeChatRequest:
        for name, neutral in (
            ("continue_final_message", False),
            ("add_special_tokens", False),
            ("chat_template", None),
            ("chat_template_kwargs", None),
            ("mm_processor_kwargs", None),
        ):
            _neutral(self, name, neutral, "is not supported (the model's own chat template renders the messages)")
        try:
            check_tool_fields(self.tools, None)
            for i, m in enumerate(self.messages):
                check_message_fields(i, m.role, m.content is not None, m.tool_calls, m.tool_call_id)
        except ToolFieldError as exc:
            raise _field_error(exc.param, exc.message, exc.value) from None
        return self


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


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


def _response_format(value: dict[str, Any]) -> StructuredOutput:
    """OpenAI's ``response_format``: ``json_object``, or ``json_schema`` with a name and a schema."""
    kind = value.get("type")
    if kind == "json_object":
        _only_keys("response_format", value, {"type"})
        return StructuredOutput(kind="json_object")
    if kind != "json_schema":
        raise _field_error("response_format.type", "must be 'text', 'json_object' or 'json_schema'", kind)
    _only_keys("response_format", value, {"type", "json_schema"})
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _field_error("response_format.json_schema", "must be an object with a name and a schema", spec)
    _only_keys("response_format.json_schema", spec, {"name", "description", "schema", "strict"})
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise _field_error("response_format.json_schema.name", "must be 1-64 letters, digits, '_' or '-'", name)
    if not isinstance(spec.get("strict", False), bool):
        raise _field_error("response_format.json_schema.strict", "must be true or false", spec["strict"])
    if not isinstance(spec.get("description", ""), str):
        raise _field_error("response_format.json_schema.description", "must be a string", spec["description"])
    return _constraint("response_format.json_schema.schema", "json", spec.get("schema"))


def _structured_outputs(value: dict[str, Any]) -> StructuredOutput:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""
    kinds = ("json", "regex", "choice", "grammar", "json_object")
    _only_keys("structured_outputs", value, set(kinds))
    given = [k for k in kinds if value.get(k) is not None]
    if len(given) != 1:
        raise _field_error("structured_outputs", f"must set exactly one of {', '.join(kinds)}", value)
    if given[0] == "json_object":
        if value["json_object"] is not True:
            raise _field_error("structured_outputs.json_object", "must be true", value["json_object"])
        return StructuredOutput(kind="json_object")
    return _constraint(f"structured_outputs.{given[0]}", given[0], value[given[0]])


def _constraint(param: str, kind: str, value: Any) -> StructuredOutput:
    """One constraint as ``StructuredOutput``; ``kind`` json (a schema: an object, or its JSON
    text), regex, grammar (non-empty text) or choice (a non-empty list of non-empty strings)."""
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                raise _field_error(param, "must be a JSON schema (an object, or its JSON text)", value) from None
        if not isinstance(schema, dict):
            raise _field_error(param, "must be a JSON schema (an object, or its JSON text)", value)
        if (unsupported := unsupported_in_schema(schema)) is not None:
            path, why, at = unsupported
            raise _field_error(f"{param}.{path}", why, at)
        return StructuredOutput(kind="json_schema", spec=json.dumps(schema, separators=(",", ":")))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _field_error(param, "must be a non-empty list of non-empty strings", value)
        return StructuredOutput(kind="choice", spec=json.dumps(value))
    if not isinstance(value, str) or not value:
        raise _field_error(
            param, f"must be a non-empty {'regular expression' if kind == 'regex' else 'grammar'}", value
        )
    if kind == "regex" and (feature := unsupported_in_regex(value)) is not None:
        raise _field_error(param, f"{feature} not supported", value)
    return StructuredOutput(kind="regex" if kind == "regex" else "grammar", spec=value)


def _only_keys(param: str, value: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise _field_error(f"{param}.{unknown[0]}", "unknown field", value[unknown[0]])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
    return isinstance(part, str) and (
        "[" in part or part in {"str", "int", "float", "bool", "list", "dict"} or part.startswith("function-")
    )


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
