"""Chat formats kvfleet knows: for model families whose checkpoints ship no chat template, and
kvfleet's own format for the byte-level tiny models.

The GGUF of Gemma-3-270M carries no ``tokenizer.chat_template``; Gemma 3's turn format is
public (``<start_of_turn>user`` / ``<start_of_turn>model`` turns closed by ``<end_of_turn>``,
system text folded into the first user turn), so kvfleet renders it with its own Jinja template
below. A checkpoint's own template always wins over these.

The tiny random models have no checkpoint tokenizer: ``ByteTokenizer`` renders chats with
``BYTE_CHAT_TEMPLATE``, one ``<|role|>\ncontent\n`` turn per message and ``<|assistant|>\n`` for
the reply, plus tools in the Qwen/Hermes manner: the functions as JSON lines in a system turn,
an assistant's calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and a tool's
result as a ``<|tool|>`` turn. JSON is written compactly (the byte models' context is short).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

# Gemma 3: the BOS token, then one turn per message; "assistant" turns are the model's; system
# messages are prepended (with a blank line) to the next user turn.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + ((message['content'] or '') | trim) + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + ((message['content'] or '') | trim)"
    " + '<end_of_turn>\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

BUILTIN_CHAT_TEMPLATES = {"gemma3_text": GEMMA3_CHAT_TEMPLATE, "gemma3": GEMMA3_CHAT_TEMPLATE}


def builtin_chat_template(model_type: str) -> str | None:
    """kvfleet's template for a ``config.json`` ``model_type``, or None if it knows none."""
    return BUILTIN_CHAT_TEMPLATES.get(model_type)


#: how the tools turn tells a model to call one
TOOLS_PREAMBLE = 'Tools; call one as <tool_call>{"name":...,"arguments":{...}}</tool_call>'

# kvfleet's byte-level format. With tools, the first turn is a system turn: the system message's
# text (if the chat starts with one), then the preamble and one JSON line per function.
BYTE_CHAT_TEMPLATE = (
    "{%- set ns = namespace(skip=0) -%}"
    "{%- if tools -%}"
    "{{- '<|system|>\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\n\n' -}}{%- set ns.skip = 1 -%}"
    "{%- endif -%}"
    "{{- preamble + '\n' -}}"
    "{%- for tool in tools -%}{{- tool['function'] | tojson + '\n' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for message in messages[ns.skip:] -%}"
    "{{- '<|' + message['role'] + '|>\n' + (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)


def render_byte_chat(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
) -> str:
    """``messages`` (and ``tools``, OpenAI's shape) in kvfleet's byte-level chat format."""
    return _byte_chat_template().render(
        messages=messages, tools=tools or [], preamble=TOOLS_PREAMBLE, add_generation_prompt=add_generation_prompt
    )


@lru_cache(maxsize=1)
def _byte_chat_template() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
    environment.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return environment.from_string(BYTE_CHAT_TEMPLATE)
