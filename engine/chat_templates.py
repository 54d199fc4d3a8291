"""Chat formats kvfleet knows for model families whose checkpoints ship no chat template.

The GGUF of Gemma-3-270M carries no ``tokenizer.chat_template``; Gemma 3's turn format is
public (``<start_of_turn>user`` / ``<start_of_turn>model`` turns closed by ``<end_of_turn>``,
system text folded into the first user turn), so kvfleet renders it with its own Jinja template
below. A checkpoint's own template always wins over these.
"""

from __future__ import annotations

# Gemma 3: the BOS token, then one turn per message; "assistant" turns are the model's; system
# messages are prepended (with a blank line) to the next user turn.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + (message['content'] | trim) + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + (message['content'] | trim)"
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
