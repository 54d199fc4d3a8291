"""Tokenizers: the checkpoint's own (transformers) or a byte-level one for tiny random models,
and incremental detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def chat_token_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...


class ByteTokenizer:
    """Bytes are token ids (0..255): the vocabulary of the tiny random models; needs no files."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def chat_token_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The tiny models' own chat format (``engine.chat_templates.BYTE_CHAT_TEMPLATE``):
        ``<|role|>\ncontent\n`` per message, then ``<|assistant|>\n`` when a reply is wanted;
        tools in a system turn first, tool calls as ``<tool_call>`` blocks."""
        from engine.chat_templates import render_byte_chat

        return self.encode(render_byte_chat(messages, tools, add_generation_prompt))


class HFTokenizer:
    """A transformers tokenizer loaded from the model directory (offline)."""

    def __init__(self, directory: Path):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(directory))
        if not getattr(self._tok, "chat_template", None):
            self._tok.chat_template = _builtin_template(directory)

    @property
    def backend(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer itself (for libraries that read its vocabulary)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)  # type: ignore[return-value]  # one id list: one string

    def chat_token_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """``messages`` (and ``tools``, OpenAI's shape) rendered by the checkpoint's own chat
        template and tokenized (the template writes the special tokens, BOS included);
        ValueError if it has none."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        from transformers import BatchEncoding

        ids = self._tok.apply_chat_template(
            messages,
            tools=tools or None,  # type: ignore[arg-type]  # a list of tool dicts, as it takes
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
        )
        if isinstance(ids, BatchEncoding):  # some transformers versions return one
            ids = ids["input_ids"]
        return [int(t) for t in ids]  # type: ignore[arg-type]  # tokenize=True: a flat list of ids


def _builtin_template(directory: Path) -> str | None:
    """kvfleet's chat template for the directory's model family, if its checkpoint has none."""
    import json

    from engine.chat_templates import builtin_chat_template

    try:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        return None
    return builtin_chat_template(str(model_type))


def load_tokenizer(directory: Path, vocab_size: int) -> Tokenizer:
    """The directory's tokenizer if it has one; the byte tokenizer for a 256-token vocabulary."""
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return HFTokenizer(directory)
    if vocab_size == 256:
        return ByteTokenizer()
    files = ", ".join(TOKENIZER_FILES)
    raise ValueError(f"{directory}: no tokenizer files ({files}) for a {vocab_size}-token vocabulary")


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas and watches for stop strings.

    Two things are held back at the end of the decoded text: U+FFFD characters (an incomplete UTF-8
    sequence, or stray bytes, that later tokens may still complete) and a tail that could be the
    start of a stop string (emitted by ``flush`` when the request ends without it); everything
    before them is emitted, and nothing emitted is ever taken back. So the text is a function of the
    token ids alone, never of how they were grouped into ``add`` calls: a stream's chunks depend on
    load (a worker coalesces chunks that pile up), and holding back a whole chunk for its last byte
    lost the characters before it for good whenever no later token completed that byte.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.token_ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False
        self._held = ""  # the decoded tail that may still start a stop string

    def add(self, token_ids: list[int]) -> str:
        """Add tokens; return the new text (cut at the earliest stop string, after which
        ``stopped`` is set). A tail that could be the start of a stop string is held back until
        later tokens show it is not (or ``flush``), so no streamed text is ever taken back."""
        self.token_ids.extend(token_ids)
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.token_ids).rstrip("\ufffd")
        start = len(self.text)  # emitted text never holds the start of a stop string
        found = [(at, stop) for stop in self.stop if (at := full.find(stop, start)) >= 0]
        if found:
            at, stop = min(found)
            full = full[: at + len(stop)] if self.include_stop else full[:at]
            self.stopped = True
            self._held = ""
            return self._emit(full)
        hold = self._stop_prefix_len(full, start)
        self._held = full[len(full) - hold :] if hold else ""
        return self._emit(full[: len(full) - hold])

    def flush(self) -> str:
        """The request ended: emit what was held back as a possible stop-string start."""
        held, self._held = self._held, ""
        self.text += held
        return held

    def _emit(self, upto: str) -> str:
        delta = upto[len(self.text) :]
        self.text = upto if len(upto) > len(self.text) else self.text
        return delta

    def _stop_prefix_len(self, full: str, start: int) -> int:
        """The longest tail of ``full`` (after ``start``) that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(full) - start), longest, -1):
                if full.endswith(stop[:k]):
                    longest = k
                    break
        return longest
