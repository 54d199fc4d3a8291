"""Tool calling for ``/v1/chat/completions``: the tool definitions a request carries, the JSON
schema that forces a call, and the parsers that turn the model's text into OpenAI tool calls.

The call format is the one kvfleet's byte-level chat template teaches (``engine/chat_templates.py``)
and the one Qwen and Hermes checkpoints write: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
What each ``tool_choice`` does (vLLM's behaviour):

* ``none``: the tools are rendered, nothing is parsed; the output is content.
* ``auto``: the model writes what it wants; each ``<tool_call>`` block becomes a call, the text
  outside the blocks the content.
* a named function: the output is constrained (``SamplingParams.structured``) to that tool's
  ``parameters`` schema and is the call's ``arguments``, written without tags.
* ``required``: the output is constrained to a JSON array of ``{"name", "arguments"}`` objects,
  one of the tools each (one item only when ``parallel_tool_calls`` is false).

A parser takes the text in pieces (a stream's deltas, or the whole text at once) and gives OpenAI
delta objects, so a streamed and a whole response are the same calls and content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, field_validator

from engine.sampling_params import SamplingParams, StructuredOutput
from engine.validation import short_repr

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
#: OpenAI's rule for function names
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: the start of a well-formed call body up to its arguments object: ``{"name": "x", "arguments": {``
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
#: a function without ``parameters`` takes none (OpenAI's meaning of leaving them out)
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class FunctionDefinition(_Body):
    """A function the model may call; ``parameters`` is a JSON schema of an object."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name_shape(cls, name: str) -> str:
        if not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"must be 1 to 64 letters, digits, underscores or dashes (got {name!r})")
        return name

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is None:
            return None
        from jsonschema import SchemaError
        from jsonschema.validators import validator_for

        try:
            validator_for(parameters).check_schema(parameters)
        except SchemaError as exc:
            raise ValueError(f"is not a valid JSON schema: {exc.message}") from None
        if parameters.get("type", "object") != "object":
            raise ValueError(f"must be the JSON schema of an object (got type {parameters['type']!r})")
        return parameters

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Body):
    """A function call in the history: ``arguments`` is JSON text of an object, as OpenAI sends it."""

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"must be the JSON text of an object (got {short_repr(arguments)})")  # noqa: TRY004 - pydantic reports only ValueError as a field error
        return arguments


class ToolCall(_Body):
    """An assistant's earlier tool call, sent back in the history."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ToolFieldError(ValueError):
    """A tool field that is well-formed alone but wrong in its request: ``param`` names it."""

    def __init__(self, param: str, message: str, value: Any):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
        self.value = value


def check_tool_fields(tools: list[ToolDefinition] | None, tool_choice: ToolChoice | None) -> None:
    """Function names are unique; ``required`` or a named function needs tools, and the name one of them."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools or []):
        name = tool.function.name
        if name in seen:
            raise ToolFieldError(
                f"tools.{i}.function.name", f"repeats the name of tools.{seen[name]} (got {name!r})", name
            )
        seen[name] = i
    if tool_choice == "required" and not tools:
        raise ToolFieldError("tool_choice", "'required' needs tools (got 'required' and no tools)", tool_choice)
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in seen:
        known = ", ".join(repr(n) for n in seen) or "no tools"
        raise ToolFieldError(
            "tool_choice.function.name",
            f"names no tool of the request ({known}) (got {tool_choice.function.name!r})",
            tool_choice.function.name,
        )


def check_message_fields(
    index: int, role: str, has_content: bool, tool_calls: list[ToolCall] | None, tool_call_id: str | None
) -> None:
    """Content is missing only from an assistant message with tool calls; ``tool_calls`` belong
    to assistant messages, ``tool_call_id`` to tool messages, which need one."""
    where = f"messages.{index}"
    if tool_calls is not None and role != "assistant":
        raise ToolFieldError(
            f"{where}.tool_calls", f"only assistant messages carry tool calls (got role {role!r})", role
        )
    if not has_content and not (role == "assistant" and tool_calls):
        raise ToolFieldError(f"{where}.content", f"required field is missing for a {role} message (got null)", None)
    if role == "tool" and not tool_call_id:
        raise ToolFieldError(
            f"{where}.tool_call_id", f"a tool message needs the id of its call (got {tool_call_id!r})", tool_call_id
        )
    if role != "tool" and tool_call_id is not None:
        raise ToolFieldError(f"{where}.tool_call_id", f"only tool messages carry one (got role {role!r})", role)


def template_message(
    role: str, text: str | None, name: str | None, tool_calls: list[ToolCall] | None, tool_call_id: str | None
) -> dict[str, Any]:
    """One history message as chat templates take it: ``developer`` is ``system``, and a call's
    arguments are an object (transformers' convention), not JSON text."""
    message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
    if name is not None:
        message["name"] = name
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
            }
            for c in tool_calls
        ]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


class ToolCallStream(Protocol):
    """Turns output text, fed in pieces, into OpenAI chat delta objects (``{"content": ...}`` or
    ``{"tool_calls": [...]}``); ``called`` says whether any call was given."""

    called: bool

    def feed(self, text: str) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...


class ToolCalling:
    """What one chat request's tools mean: the tools its template renders, the structured-output
    constraint its ``tool_choice`` needs, and a parser per choice for its output.

    Invariant: ``mode`` is ``named`` exactly when ``forced_name`` is set."""

    def __init__(self, tools: list[ToolDefinition], tool_choice: ToolChoice | None, parallel_tool_calls: bool):
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls
        self.forced_name: str | None = None
        self.mode: Literal["none", "auto", "required", "named"] = "auto"
        if isinstance(tool_choice, NamedToolChoice):
            self.forced_name, self.mode = tool_choice.function.name, "named"
        elif tool_choice is not None:
            self.mode = tool_choice

    @classmethod
    def of(
        cls, tools: list[ToolDefinition] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool
    ) -> ToolCalling | None:
        """The request's tool calling, or None when it has no tools."""
        return cls(tools, tool_choice, parallel_tool_calls) if tools else None

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape, unset fields left out)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow, or None when the model writes freely."""
        if self.mode == "named":
            return next(t.function.parameters_schema for t in self.tools if t.function.name == self.forced_name)
        if self.mode != "required":
            return None
        one_call = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters_schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
        if not self.parallel_tool_calls:
            array["maxItems"] = 1
        return array

    def constrain(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with the output constrained to the call's JSON for ``required`` and a
        named function (``SamplingParams.structured``); ToolFieldError if it already has a
        constraint (``response_format``)."""
        schema = self.schema()
        if schema is None:
            return sampling
        if sampling.structured is not None:
            choice = self.forced_name or self.mode
            raise ToolFieldError(
                "tool_choice",
                f"cannot force a call ({choice!r}) together with response_format (got {sampling.structured.kind!r})",
                choice,
            )
        return sampling.replace(structured=StructuredOutput(kind="json_schema", spec=json.dumps(schema)))

    def stream(self) -> ToolCallStream:
        """A fresh parser of one choice's output."""
        if self.mode == "named":
            assert self.forced_name is not None  # the class invariant
            return NamedCallStream(self.forced_name)
        if self.mode == "required":
            return RequiredCallStream()
        if self.mode == "auto":
            return TaggedCallParser()
        return ContentStream()

    def message(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """The whole response's assistant message and finish reason for ``text``."""
        parser = self.stream()
        deltas = parser.feed(text) + parser.finish()
        return merge_deltas(deltas), finish_reason_of(parser, finish_reason)


def finish_reason_of(parser: ToolCallStream, finish_reason: str) -> str:
    """``tool_calls`` when the output made calls and was not cut off by ``max_tokens``."""
    return "tool_calls" if parser.called and finish_reason != "length" else finish_reason


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a client builds from ``deltas`` (content None when there is none)."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(
                part["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = part.get("id", call["id"])
            call["function"]["name"] += part.get("function", {}).get("name", "")
            call["function"]["arguments"] += part.get("function", {}).get("arguments", "")
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def _call_start(index: int, name: str, arguments: str = "") -> dict[str, Any]:
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    return {
        "tool_calls": [
            {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ]
    }


def _arguments(index: int, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


class ContentStream:
    """``tool_choice: none``: everything is content."""

    def __init__(self) -> None:
        self.called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict[str, Any]]:
        return []


class NamedCallStream:
    """A named function: the whole output is that function's arguments."""

    def __init__(self, name: str):
        self.name = name
        self.called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        out = [] if self.called else [_call_start(0, self.name)]
        self.called = True
        return out + ([_arguments(0, text)] if text else [])

    def finish(self) -> list[dict[str, Any]]:
        return self.feed("")


class RequiredCallStream:
    """``required``: the output is a JSON array of calls; it is parsed once whole, so the calls
    come at the end of a stream (each with its whole arguments). An output that is no such
    array (cut off by ``max_tokens``) is content."""

    def __init__(self) -> None:
        self.called = False
        self._text = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        return []

    def finish(self) -> list[dict[str, Any]]:
        calls = _parse_call_list(self._text)
        if calls is None:
            return [{"content": self._text}] if self._text else []
        self.called = bool(calls)
        return [_call_start(i, name, arguments) for i, (name, arguments) in enumerate(calls)]


def _parse_call_list(text: str) -> list[tuple[str, str]] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = [_call_of(item) for item in items]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


def _call_of(value: Any) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a parsed call object, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class TaggedCallParser:
    """``tool_choice: auto``: text streams as content until a ``<tool_call>`` opens; a block
    written as ``{"name": "f", "arguments": {...}}`` gives the call's start as soon as its
    arguments open, then the arguments text as it arrives; any other block is parsed when it
    closes (or the output ends) and is a call if it is a JSON call object, else content again.

    Held back until later text decides: a tail that may start ``<tool_call>`` (or, inside the
    arguments, ``</tool_call>``), and whitespace after the content so far (dropped at the end
    when calls were made, so a response of calls alone has no content).
    """

    def __init__(self) -> None:
        self.called = False
        self._pending = ""  # fed text not yet handled
        self._spaces = ""  # trailing whitespace of the content, held back
        self._in_block = False
        self._body = ""  # the open block's text
        self._index = 0  # the next call's index
        self._args_at: int | None = None  # where the open block's arguments start, once its call started
        self._scan_at = 0  # arguments scanned (and given) up to here
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._args_done = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> list[dict[str, Any]]:
        out = self._advance(final=True)
        if self._in_block:
            out += self._close_block(closed=False)
        out += self._content(self._pending, final=True)
        self._pending = ""
        return out

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self._in_block:
                self._body += self._pending
                self._pending = ""
                closed, deltas = self._block(final)
                out += deltas
                if not closed:
                    return out
                continue
            at = self._pending.find(TOOL_CALL_OPEN)
            if at < 0:
                hold = 0 if final else _prefix_tail(self._pending, TOOL_CALL_OPEN)
                out += self._content(self._pending[: len(self._pending) - hold], final=False)
                self._pending = self._pending[len(self._pending) - hold :]
                return out
            out += self._content(self._pending[:at], final=False)
            self._pending = self._pending[at + len(TOOL_CALL_OPEN) :]
            self._open_block()

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        text = self._spaces + text
        body = text.rstrip()
        self._spaces = text[len(body) :]
        if final and not self.called:
            body, self._spaces = text, ""
        return [{"content": body}] if body else []

    def _open_block(self) -> None:
        self._in_block, self._body, self._args_at = True, "", None
        self._scan_at, self._depth, self._in_string, self._escaped, self._args_done = 0, 0, False, False, False

    def _block(self, final: bool) -> tuple[bool, list[dict[str, Any]]]:
        """Advance the open block; ``(closed, deltas)``, leaving text after its end in ``_pending``."""
        out: list[dict[str, Any]] = []
        if self._args_at is None:
            head = _CALL_HEAD.match(self._body)
            if head is None:
                at = self._body.find(TOOL_CALL_CLOSE)
                if at < 0:
                    return False, out
                self._pending = self._body[at + len(TOOL_CALL_CLOSE) :] + self._pending
                self._body = self._body[:at]
                return True, self._close_block(closed=True)
            self._args_at = self._scan_at = head.end()
            self.called = True
            out.append(_call_start(self._index, head.group(1)))
        if not self._args_done:
            start = self._scan_at
            ended_at = self._scan_arguments(final)
            if self._scan_at > start:
                out.append(_arguments(self._index, self._body[start : self._scan_at]))
            if ended_at is not None:  # a close tag inside unfinished arguments ends the block
                self._pending = self._body[ended_at + len(TOOL_CALL_CLOSE) :] + self._pending
                return self._end_call(), out
            if not self._args_done:
                return False, out
        at = self._body.find(TOOL_CALL_CLOSE, self._scan_at)
        if at < 0:
            return False, out
        self._pending = self._body[at + len(TOOL_CALL_CLOSE) :] + self._pending
        return self._end_call(), out

    def _scan_arguments(self, final: bool) -> int | None:
        """Move ``_scan_at`` over the arguments object; the position of a close tag met outside
        its strings before it ended, else None."""
        body = self._body
        while self._scan_at < len(body) and not self._args_done:
            char = body[self._scan_at]
            if self._in_string:
                self._in_string = self._escaped or char != '"'
                self._escaped = not self._escaped and char == "\\"
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                self._args_done = self._depth == 0
            elif char == "<" and body.startswith(TOOL_CALL_CLOSE, self._scan_at):
                return self._scan_at
            elif char == "<" and not final and TOOL_CALL_CLOSE.startswith(body[self._scan_at :]):
                return None  # maybe a close tag: wait for more text
            self._scan_at += 1
        return None

    def _end_call(self) -> bool:
        self._index += 1
        self._in_block = False
        return True

    def _close_block(self, closed: bool) -> list[dict[str, Any]]:
        """The open block ends (``closed``: at its close tag, else with the output): a started
        call ends there; otherwise the block is a call if its text is a JSON call object, else
        content again, tags included as the model wrote them."""
        self._in_block = False
        if self._args_at is not None:
            self._index += 1
            return []
        call = _parse_call_text(self._body)
        if call is None:
            return self._content(TOOL_CALL_OPEN + self._body + (TOOL_CALL_CLOSE if closed else ""), final=False)
        self.called = True
        self._index += 1
        return [_call_start(self._index - 1, *call)]


def _parse_call_text(text: str) -> tuple[str, str] | None:
    try:
        return _call_of(json.loads(text))
    except ValueError:
        return None


def _prefix_tail(text: str, tag: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
