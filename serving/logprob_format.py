"""Logprobs in OpenAI's two response shapes, from the engine's ``TokenLogprob`` records.

``/v1/completions`` (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``, four lists with one entry per token; ``top_logprobs`` maps token strings to
logprobs and holds the chosen token besides the ``k`` most likely (so up to ``k + 1`` entries);
with ``echo`` the prompt's tokens come first, the first of them with ``None`` for its logprob and
its top logprobs (nothing predicts it). ``text_offset`` is each token's character offset in the
choice's text (which, with ``echo``, starts with the prompt).

``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}, ...]}`` with exactly ``k`` alternatives per token.

A token's string and ``bytes`` come from the token's own bytes (``Tokenizer.token_bytes``: a
byte-fallback ``<0xF0>`` is the byte 0xF0, a byte-level piece that ends inside a character is
the bytes it holds), never from decoding the token alone, which turns part of a character into
U+FFFD. The string is those bytes as text when they are whole characters, else OpenAI's
``bytes:\\xNN...`` form; a token that decoding skips (a special token) is ``""`` with no bytes.
So the tokens' bytes of a text the tokenizer round-trips join to its UTF-8, and ``text_offset``
counts the characters the bytes before each token complete (an emoji split into four byte
tokens: all four at the emoji's offset, the next token one character on). Logprobs of ``-inf`` are reported as
``LOGPROB_FLOOR``: JSON has no infinity.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from engine.logprobs import TokenLogprob
from engine.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # stands for -inf (a masked or impossible token) in JSON


class TokenStrings:
    """Each token id's string and raw bytes for one tokenizer, computed once per id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def of(self, token_id: int) -> tuple[str, bytes]:
        known = self._cache.get(token_id)
        if known is None:
            known = self._cache[token_id] = self._compute(token_id)
        return known

    def text(self, token_id: int) -> str:
        return self.of(token_id)[0]

    def raw(self, token_id: int) -> bytes:
        return self.of(token_id)[1]

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token_id)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        if raw and (not text or "\ufffd" in text):
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, raw


class TextOffsets:
    """Character offsets of successive tokens in a text that starts at ``start``: a token begins
    where the characters completed by the bytes before it end (an incremental UTF-8 decoder)."""

    def __init__(self, strings: TokenStrings, start: int = 0):
        self.strings = strings
        self.position = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token_id: int) -> int:
        """This token's offset; then move past it."""
        at = self.position
        self.position += len(self._decoder.decode(self.strings.raw(token_id)))
        return at


def clamp(logprob: float) -> float:
    return max(LOGPROB_FLOOR, logprob)


class CompletionLogprobs:
    """Builds the legacy completions ``logprobs`` object of one choice, piece by piece (a
    streamed choice sends each piece with its chunk; the offsets go on across pieces)."""

    def __init__(self, strings: TokenStrings, start: int = 0):
        self.strings = strings
        self.offsets = TextOffsets(strings, start)

    def prompt(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        """The echoed prompt's tokens: ``logprobs[i]`` for token ``i`` (None for the first)."""
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"{len(logprobs)} prompt logprobs for {len(token_ids)} prompt tokens")
        piece = _empty()
        for token_id, entry in zip(token_ids, logprobs, strict=True):
            self._add(piece, token_id, entry)
        return piece

    def output(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """Generated tokens, one ``TokenLogprob`` each."""
        piece = _empty()
        for entry in logprobs:
            self._add(piece, entry.token_id, entry)
        return piece

    def _add(self, piece: dict[str, Any], token_id: int, entry: TokenLogprob | None) -> None:
        piece["tokens"].append(self.strings.text(token_id))
        piece["text_offset"].append(self.offsets.advance(token_id))
        if entry is None:
            piece["token_logprobs"].append(None)
            piece["top_logprobs"].append(None)
            return
        piece["token_logprobs"].append(clamp(entry.logprob))
        top = {self.strings.text(t): clamp(lp) for t, lp in entry.top}
        top.setdefault(self.strings.text(entry.token_id), clamp(entry.logprob))
        piece["top_logprobs"].append(top)


def join_completion_pieces(*pieces: dict[str, Any]) -> dict[str, Any]:
    """Several pieces of one choice (prompt, then output) as one ``logprobs`` object."""
    whole = _empty()
    for piece in pieces:
        for key in whole:
            whole[key].extend(piece[key])
    return whole


def chat_logprobs(strings: TokenStrings, logprobs: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``logprobs``' tokens with ``top`` alternatives each."""
    return {"content": [_chat_entry(strings, e, top) for e in logprobs]}


def _chat_entry(strings: TokenStrings, entry: TokenLogprob, top: int) -> dict[str, Any]:
    text, raw = strings.of(entry.token_id)
    alternatives = [
        {"token": strings.text(t), "logprob": clamp(lp), "bytes": list(strings.raw(t))} for t, lp in entry.top[:top]
    ]
    return {"token": text, "logprob": clamp(entry.logprob), "bytes": list(raw), "top_logprobs": alternatives}


def cumulative_logprob(logprobs: Sequence[TokenLogprob] | None) -> float:
    """The sum of a sample's token logprobs (how ``best_of`` ranks samples)."""
    if logprobs is None:
        raise RuntimeError("the cluster returned no logprobs for a best_of sample")
    return sum(entry.logprob for entry in logprobs)


def _empty() -> dict[str, Any]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
