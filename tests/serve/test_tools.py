"""Tool calling in chat: the byte-level chat format with tools, the checks at the edge, the
schemas that force a call, the ``<tool_call>`` parser (whole and streamed), and the real server
through the ``openai`` client (a chat with two tools and a tool result, ``tool_choice`` none,
auto, required and named, streamed and not)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import ValidationError

from engine.sampling_params import SamplingParams, StructuredOutput
from engine.tokenizer import ByteTokenizer, HFTokenizer
from serving.protocol import ChatCompletionRequest, describe
from serving.tools import (
    RequiredCallStream,
    TaggedCallParser,
    ToolCalling,
    ToolDefinition,
    ToolFieldError,
    merge_deltas,
)
from tests.serve.conftest import Server
from tests.serve.test_openai_api import GREEDY, oracle

# small: the byte models' context is 512 tokens, and the tools are rendered into the prompt
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}
TIME_PARAMETERS = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}
WEATHER = {
    "type": "function",
    "function": {"name": "weather", "description": "Weather", "parameters": WEATHER_PARAMETERS},
}
TIME = {"type": "function", "function": {"name": "time", "parameters": TIME_PARAMETERS}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {"weather": WEATHER_PARAMETERS, "time": TIME_PARAMETERS}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4C"},
]
#: a forced call starts the chat, leaving room for its JSON
QUESTION = HISTORY[:1]
CALLS_TEXT = (
    'Let me check.\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "unit": "C", "note": "a}<\\"b"}}'
    '</tool_call>\n<tool_call>{"arguments": {"utc": true}, "name": "time"}</tool_call>\n'
)


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": HISTORY, "tools": TOOLS, **fields}


def _calling(**fields: Any) -> ToolCalling:
    calling = ChatCompletionRequest.model_validate(_body(**fields)).tool_calling
    assert calling is not None
    return calling


def _refusal(**fields: Any) -> tuple[str, str]:
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(_body(**fields))
    return describe(caught.value)


# -- the byte-level chat format -----------------------------------------------------------------------


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_chat_without_tools_renders_as_before(generation_prompt: bool) -> None:
    messages = [
        {"role": "system", "content": "Be {{brief}}."},
        {"role": "user", "content": "é\n{% raw %}"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "x"},
    ]
    documented = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    documented += "<|assistant|>\n" if generation_prompt else ""
    assert ByteTokenizer().chat_token_ids(messages, generation_prompt) == list(documented.encode())


def test_tools_render_in_a_system_turn_and_calls_as_tool_call_blocks() -> None:
    messages = [{"role": "system", "content": "Be brief."}] + [
        ChatCompletionRequest.model_validate(_body()).messages[i].for_template() for i in range(3)
    ]
    calling = _calling()
    text = ByteTokenizer().decode(ByteTokenizer().chat_token_ids(messages, True, calling.template_tools()))
    functions = "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in TOOLS)
    assert text == (
        "<|system|>\nBe brief.\n\n"
        'Tools; call one as <tool_call>{"name":...,"arguments":{...}}</tool_call>\n'
        f"{functions}\n"
        "<|user|>\nOslo?\n"
        '<|assistant|>\n<tool_call>{"name":"weather","arguments":{"city":"Oslo"}}</tool_call>\n'
        "<|tool|>\n4C\n"
        "<|assistant|>\n"
    )


def test_a_checkpoint_template_gets_the_tools_and_calls_with_object_arguments(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # one token per byte: text round-trips
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    checkpoint = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    checkpoint.chat_template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}({{ c.function.name }}:{{ c.function.arguments | tojson }}){% endfor %}"
        "{% endfor %}"
    )
    checkpoint.save_pretrained(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    messages = [m.for_template() for m in ChatCompletionRequest.model_validate(_body()).messages]
    ids = tokenizer.chat_token_ids(messages, False, _calling().template_tools())
    assert tokenizer.decode(ids) == '[weather][time]<user>Oslo?<assistant>(weather:{"city": "Oslo"})<tool>4C'
    assert tokenizer.decode(tokenizer.chat_token_ids(messages[:1], False)) == "<user>Oslo?"


# -- checks at the edge -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "repeats the name of tools.0"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
            "'string'",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools.0.function.parameters",
            "not a valid JSON schema",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "'a b'"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type", "code"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "'nope'"),
        ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages.0.tool_call_id", "needs the id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0.tool_call_id", "'user'"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "missing"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages.0.content", "missing"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}]},
            "messages.0.tool_calls",
            "'user'",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
            "'{oops'",
        ),
    ],
)
def test_a_bad_tool_field_is_refused_naming_the_field_and_value(
    fields: dict[str, Any], param: str, fragment: str
) -> None:
    got_param, message = _refusal(**fields)
    assert got_param == param, message
    assert message.startswith(f"{param}: ") and fragment in message, message


def test_tool_messages_and_choices_are_accepted() -> None:
    for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "time"}}):
        request = ChatCompletionRequest.model_validate(_body(tool_choice=choice, parallel_tool_calls=False))
        assert request.tool_calling is not None
    assert ChatCompletionRequest.model_validate(_body(tools=None)).tool_calling is None


# -- the schemas that force a call --------------------------------------------------------------------


def test_a_named_function_constrains_the_output_to_its_parameters() -> None:
    calling = _calling(tool_choice={"type": "function", "function": {"name": "time"}})
    sampling = calling.constrain(SamplingParams(max_tokens=8))
    assert sampling.structured == StructuredOutput(kind="json_schema", spec=json.dumps(TIME_PARAMETERS))
    no_parameters = _calling(
        tools=[{"type": "function", "function": {"name": "ping"}}],
        tool_choice={"type": "function", "function": {"name": "ping"}},
    )
    assert no_parameters.schema() == {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_the_output_to_a_list_of_calls_of_the_tools(parallel: bool) -> None:
    calling = _calling(tool_choice="required", parallel_tool_calls=parallel)
    sampling = calling.constrain(SamplingParams(max_tokens=8))
    assert sampling.structured is not None and sampling.structured.kind == "json_schema"
    schema = json.loads(sampling.structured.spec)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "time", "arguments": {"utc": True}}, {"name": "weather", "arguments": {"city": "Rome"}}]
    bad = [
        [],
        [{"name": "time", "arguments": {"city": "Rome"}}],
        [{"name": "date", "arguments": {}}],
        [{"name": "time"}],
    ]
    assert jsonschema.Draft202012Validator(schema).is_valid(ok[:1])
    assert jsonschema.Draft202012Validator(schema).is_valid(ok) == parallel
    assert not any(jsonschema.Draft202012Validator(schema).is_valid(b) for b in bad)


def test_auto_and_none_leave_the_output_free_and_a_forced_call_refuses_another_constraint() -> None:
    assert _calling(tool_choice="auto").constrain(SamplingParams()) == SamplingParams()
    assert _calling(tool_choice="none").constrain(SamplingParams()) == SamplingParams()
    json_mode = SamplingParams(structured=StructuredOutput(kind="json_object"))
    with pytest.raises(ToolFieldError, match=r"^tool_choice: cannot force a call"):
        _calling(tool_choice="required").constrain(json_mode)


# -- the parsers --------------------------------------------------------------------------------------


def _in_pieces(text: str, seed: int, make: Any = TaggedCallParser) -> tuple[dict[str, Any], bool]:
    rng = random.Random(seed)
    parser = make()
    deltas, at = [], 0
    while at < len(text):
        step = rng.randint(1, 6)
        deltas += parser.feed(text[at : at + step])
        at += step
    deltas += parser.finish()
    return merge_deltas(deltas), parser.called


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{**c, "id": c["id"].startswith("call_") and len(c["id"]) > 5} for c in message.get("tool_calls", [])]
    return {**message, **({"tool_calls": calls} if calls else {})}


def test_tool_call_blocks_become_calls_and_the_rest_content() -> None:
    message, reason = _calling().message(CALLS_TEXT, "stop")
    assert reason == "tool_calls"
    assert message["content"] == "Let me check."
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["weather", "time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C", "note": 'a}<"b'}
    assert json.loads(calls[1]["function"]["arguments"]) == {"utc": True}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ("no calls here  \n", "no calls here  \n", []),
        ("a <tool_ b", "a <tool_ b", []),
        ("<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", []),
        ('<tool_call>{"name": "time", "arguments": {"utc": [1, {"b": 2}]', None, ["time"]),
        ('<tool_call>{"name": "time", "arguments": {"utc": 1</tool_call>after', "after", ["time"]),
        ('  <tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>\n', None, ["time"]),
    ],
)
def test_streamed_pieces_give_the_same_message_as_the_whole_text(
    text: str, content: str | None, names: list[str]
) -> None:
    whole, _ = _calling().message(text, "stop")
    assert whole["content"] == content
    assert [c["function"]["name"] for c in whole.get("tool_calls", [])] == names
    for seed in range(50):
        assert _without_ids(_in_pieces(text, seed)[0]) == _without_ids(whole)
    assert _without_ids(_in_pieces(CALLS_TEXT, 0)[0]) == _without_ids(_calling().message(CALLS_TEXT, "stop")[0])


def test_a_call_streams_its_start_then_its_arguments_as_they_arrive() -> None:
    parser = TaggedCallParser()
    assert parser.feed("Hi <tool_ca") == [{"content": "Hi"}]
    assert parser.feed('ll>{"name": "time", "argu') == []
    start, arguments = parser.feed('ments": {"utc"')
    call = start["tool_calls"][0]
    assert (call["index"], call["type"], call["function"]) == (0, "function", {"name": "time", "arguments": ""})
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": '{"utc"'}}]}
    rest = parser.feed(": true}}</tool_call> ")
    assert rest == [{"tool_calls": [{"index": 0, "function": {"arguments": ": true}"}}]}]
    assert parser.finish() == [] and parser.called


def test_none_parses_nothing_and_length_stays_the_finish_reason() -> None:
    message, reason = _calling(tool_choice="none").message(CALLS_TEXT, "stop")
    assert (message, reason) == ({"role": "assistant", "content": CALLS_TEXT}, "stop")
    assert _calling().message(CALLS_TEXT, "length")[1] == "length"


def test_forced_calls_wrap_the_json_output() -> None:
    named = _calling(tool_choice={"type": "function", "function": {"name": "time"}})
    message, reason = named.message('{"utc": false}', "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("time", '{"utc": false}')
    ]
    text = '[{"name": "time", "arguments": {"utc": true}}, {"name": "weather", "arguments": {}}]'
    message, reason = _calling(tool_choice="required").message(text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("time", {"utc": True}),
        ("weather", {}),
    ]
    assert _without_ids(_in_pieces(text, 3, RequiredCallStream)[0]) == _without_ids(message)
    cut = _calling(tool_choice="required").message('[{"name": "time", "argu', "length")
    assert cut == ({"role": "assistant", "content": '[{"name": "time", "argu'}, "length")


# -- the real server ----------------------------------------------------------------------------------

MAX_TOKENS = 12
FORCED_MAX_TOKENS = 120


def _streamed_message(chunks: list[Any]) -> tuple[dict[str, Any], str | None]:
    """The assistant message a client assembles from streamed chunks, and the finish reason."""
    deltas: list[dict[str, Any]] = []
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            delta.pop("role", None)
            for call in delta.get("tool_calls", []):
                call.setdefault("function", {})
            deltas.append(delta)
            reason = choice.finish_reason or reason
    return merge_deltas(deltas), reason


def _whole_message(reply: Any) -> dict[str, Any]:
    message = reply.choices[0].message.model_dump(exclude_none=True)
    message.setdefault("content", None)
    return {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_a_chat_with_two_tools_and_a_tool_result_round_trips(server: Server, tool_choice: str) -> None:
    client = server.openai()
    request = ChatCompletionRequest.model_validate(_body(tool_choice=tool_choice))
    calling = request.tool_calling
    assert calling is not None
    messages = [m.for_template() for m in request.messages]
    rendered = ByteTokenizer().chat_token_ids(messages, True, calling.template_tools())
    (expected,) = oracle(server.config, (ByteTokenizer().decode(rendered),), MAX_TOKENS)
    expected_message, expected_reason = calling.message(expected.text, "length")
    kwargs = {
        "model": server.model,
        "messages": HISTORY,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": MAX_TOKENS,
        **GREEDY,
    }

    whole = client.chat.completions.create(**kwargs)
    assert whole.usage.prompt_tokens == len(rendered)
    assert _without_ids(_whole_message(whole)) == _without_ids(expected_message)
    assert whole.choices[0].finish_reason == expected_reason

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    message, reason = _streamed_message(chunks)
    assert _without_ids(message) == _without_ids(_whole_message(whole))
    assert reason == expected_reason


def _check_calls(message: dict[str, Any], names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    calls = message.get("tool_calls") or []
    assert calls, message
    parsed = []
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        assert name in names
        jsonschema.validate(arguments, PARAMETERS[name])
        parsed.append((name, arguments))
    return parsed


#: how each forced choice samples: greedy, except ``required`` with parallel calls, where the
#: greedy random model repeats its call until ``max_tokens``; seed 3 ends the list after two calls
#: (a seeded draw depends only on the seed and the token's position: ``engine.sampler.draw_seed``)
FORCED = {
    "weather": ({"type": "function", "function": {"name": "weather"}}, True, {}),
    "time": ({"type": "function", "function": {"name": "time"}}, True, {}),
    "required-one": ("required", False, {}),
    "required": ("required", True, {"temperature": 1.0, "seed": 3}),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", list(FORCED))
def test_a_forced_tool_choice_gives_calls_that_validate_against_the_tool_schema(
    server: Server, choice: str, stream: bool
) -> None:
    client = server.openai()
    tool_choice, parallel, sampling = FORCED[choice]
    names = set(PARAMETERS) if tool_choice == "required" else {choice}
    reply = client.chat.completions.create(
        model=server.model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=tool_choice,
        stream=stream,
        parallel_tool_calls=parallel,
        max_tokens=FORCED_MAX_TOKENS,
        **({"temperature": 0.0} | sampling),
    )
    if stream:
        message, reason = _streamed_message(list(reply))
    else:
        message, reason = _whole_message(reply), reply.choices[0].finish_reason
    assert reason == "tool_calls", message
    assert message["content"] is None
    calls = _check_calls(message, names)
    assert len(calls) == 1 or parallel

    # the call goes back into the history with its result, and the chat goes on
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": message["tool_calls"][:1]},
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "ok"},
    ]
    reply = client.chat.completions.create(
        model=server.model, messages=history, tools=TOOLS, max_tokens=4, temperature=0.0
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_cut_off_by_max_tokens_are_the_text_with_finish_reason_length(
    server: Server, stream: bool
) -> None:
    reply = server.openai().chat.completions.create(
        model=server.model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        stream=stream,
        max_tokens=40,
        temperature=0.0,
    )
    if stream:
        message, reason = _streamed_message(list(reply))
    else:
        message, reason = _whole_message(reply), reply.choices[0].finish_reason
    assert reason == "length"
    assert "tool_calls" not in message
    assert message["content"].startswith('[{"name": "') and len(message["content"].encode()) == 40


def test_a_bad_tool_is_a_400_the_openai_client_sees_with_its_param(server: Server) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=server.model,
            messages=HISTORY,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "date"}},
        )
    assert caught.value.body["param"] == "tool_choice.function.name"  # type: ignore[index]
    assert "'date'" in caught.value.body["message"]  # type: ignore[index]


def test_tool_definitions_are_openai_shaped() -> None:
    assert ToolDefinition.model_validate(WEATHER).model_dump(exclude_none=True) == WEATHER
