"""Tokenizers: the checkpoint's own (transformers) or a byte-level one for tiny random models,
and incremental detokenization with stop strings.

Each tokenizer also names a token's own bytes (``token_bytes``): what the token adds to the
UTF-8 of a decoded text. A token may hold part of a character (a byte-fallback ``<0xF0>``, or a
byte-level BPE piece that ends inside a character), so decoding it alone (which replaces the
part with U+FFFD) does not give them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; ``add_special_tokens``: with the ones the tokenizer adds to
        every text (a BOS)."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: what it adds to the UTF-8 of ``decode``'s text (b"" for a
        token ``decode`` skips, such as a special token)."""
        ...

    def chat_token_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...


class ByteTokenizer:
    """Bytes are token ids (0..255): the vocabulary of the tiny random models; needs no files."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # no special tokens to add

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

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
        self._pieces: PieceBytes | None = None  # built on the first ``token_bytes``

    @property
    def backend(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer itself (for libraries that read its vocabulary)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)  # type: ignore[return-value]  # one id list: one string

    def token_bytes(self, token_id: int) -> bytes:
        """Read from the token's vocabulary piece through the tokenizer's decoder rules
        (``PieceBytes``); a vocabulary whose decoder has other rules gives the token's decoded
        text (such vocabularies hold whole characters)."""
        if self._pieces is None:
            self._pieces = PieceBytes(self._tok)
        return self._pieces.of(token_id, self.decode)

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


class PieceBytes:
    """A transformers tokenizer's vocabulary pieces as bytes, by the rules of its decoder.

    The rules understood (``tokenizers``' decoder types): ``ByteLevel`` (GPT-2's byte-to-character
    alphabet: each character of a piece stands for one byte, a character outside the alphabet
    for its own UTF-8), and a ``Sequence`` of ``Replace`` (a plain-string pattern),
    ``ByteFallback`` (a piece ``<0xNN>`` is the byte NN), ``Fuse`` and ``Strip``, or ``Metaspace``
    (``▁`` is a space): SentencePiece's. ``Strip`` and ``Metaspace`` drop a space at the start of a
    whole text only, which no single token owns, so they change no token's bytes. Special tokens
    (which ``HFTokenizer.decode`` skips) have none. ``usable`` is False for any other decoder.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self._tokenizer = tokenizer
        added = tokenizer.added_tokens_decoder
        self._special = frozenset([*tokenizer.all_special_ids, *(i for i, t in added.items() if t.special)])
        self._byte_of: dict[str, int] | None = None  # the ByteLevel alphabet, character -> byte
        self._replace: list[tuple[str, str]] = []
        self._byte_fallback = False
        self.usable = self._read_decoder(_decoder_json(tokenizer))

    def of(self, token_id: int, decode: Callable[[list[int]], str]) -> bytes:
        """Token ``token_id``'s bytes; ``decode`` (of one token) where the decoder is not understood."""
        if token_id in self._special:
            return b""
        if not self.usable:
            return decode([token_id]).encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if self._byte_of is not None:
            byte_of = self._byte_of
            return b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in piece)
        if self._byte_fallback and (raw := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(raw.group(1), 16)])
        for pattern, content in self._replace:
            piece = piece.replace(pattern, content)
        return piece.encode("utf-8")

    def _read_decoder(self, decoder: dict[str, object] | None) -> bool:
        """Take the rules of a decoder (a ``Sequence``'s steps in turn); False for a rule that
        is none of those above."""
        if not decoder:
            return False
        steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
        if not isinstance(steps, list):
            return False
        for step in steps:
            kind = step.get("type") if isinstance(step, dict) else None
            if kind == "ByteLevel":
                self._byte_of = {c: b for b, c in _byte_level_alphabet().items()}
            elif kind == "ByteFallback":
                self._byte_fallback = True
            elif kind == "Replace" and isinstance(pattern := step.get("pattern"), dict) and "String" in pattern:
                self._replace.append((str(pattern["String"]), str(step.get("content", ""))))
            elif kind == "Metaspace":
                self._replace.append((str(step.get("replacement", "\u2581")), " "))
            elif kind not in ("Fuse", "Strip"):
                return False
        return True


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_json(tokenizer: PreTrainedTokenizerBase) -> dict[str, object] | None:
    """The ``decoder`` section of a fast tokenizer's ``tokenizer.json`` (None without one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    try:
        state = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return None
    return state if isinstance(state, dict) else None


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte. Printable bytes
    stand for themselves; the others (controls, space, DEL..NBSP, the soft hyphen) take the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + shifted)
            shifted += 1
    return alphabet


def _builtin_template(directory: Path) -> str | None:
    """kvfleet's chat template for the directory's model family, if its checkpoint has none."""
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
