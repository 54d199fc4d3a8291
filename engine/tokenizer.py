"""Tokenizers: the checkpoint's own (transformers) or a byte-level one for tiny random models,
and incremental detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def chat_token_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]: ...


class ByteTokenizer:
    """Bytes are token ids (0..255): the vocabulary of the tiny random models; needs no files."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def chat_token_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The tiny models' own chat format: ``<|role|>\ncontent\n`` per message, then
        ``<|assistant|>\n`` when a reply is wanted."""
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return self.encode(text + ("<|assistant|>\n" if add_generation_prompt else ""))


class HFTokenizer:
    """A transformers tokenizer loaded from the model directory (offline)."""

    def __init__(self, directory: Path):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(directory))
        if not getattr(self._tok, "chat_template", None):
            self._tok.chat_template = _builtin_template(directory)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def chat_token_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """``messages`` rendered by the checkpoint's own chat template and tokenized (the
        template writes the special tokens, BOS included); ValueError if it has none."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        ids = self._tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in some versions
            ids = ids["input_ids"]
        return [int(t) for t in ids]


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
    raise ValueError(f"{directory}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) for a {vocab_size}-token vocabulary")


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas and watches for stop strings.

    Only the U+FFFD characters at the end of the decoded text are held back (an incomplete UTF-8
    sequence, or stray bytes, that later tokens may still complete); everything before them is
    emitted. So the text is a function of the token ids alone, never of how they were grouped
    into ``add`` calls: a stream's chunks depend on load (a worker coalesces chunks that pile
    up), and holding back a whole chunk for its last byte lost the characters before it for
    good whenever no later token completed that byte.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Add tokens; return the new text (cut at a stop string, after which ``stopped`` is set)."""
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids).rstrip("\ufffd")
        if len(full) <= len(self.text):
            return ""
        for stop in self.stop:
            at = full.find(stop, max(0, len(self.text) - len(stop)))
            if at >= 0:
                full = full[: at + len(stop)] if self.include_stop else full[:at]
                self.stopped = True
                break
        delta = full[len(self.text) :]
        self.text = full
        return delta
