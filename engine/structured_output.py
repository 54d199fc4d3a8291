"""Structured output while sampling: a request's grammar (``engine.structured_spec.grammar_of``)
compiled against one model's vocabulary, applied as a mask of the tokens that keep the output
inside that grammar, with one matcher per request walked as its tokens are sampled.

When a request's grammar is complete:
- the model has an end-of-sequence token: the mask allows it where the grammar may end, and the
  request stops when it is sampled, or at once when nothing but it may follow (no extra step,
  and no end-of-sequence token in the output);
- the model has none (a tiny random byte model): the request stops the first time the output
  is a whole match of the grammar.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.sampling_params import StructuredOutput
from engine.structured_spec import grammar_of, load_xgrammar
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    import xgrammar  # imported at run time by ``load_xgrammar`` on first use

#: compiled grammars kept per engine (the oldest is dropped beyond this many)
MAX_CACHED_GRAMMARS = 256


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    """The vocabulary as xgrammar sees it: ``vocab_size`` is the model's (its logits' width);
    ids the tokenizer does not have are never allowed. ``eos_token_ids`` end a complete output."""
    xgrammar = load_xgrammar()

    stop = [t for t in eos_token_ids if 0 <= t < vocab_size]
    if isinstance(tokenizer, ByteTokenizer):
        return xgrammar.TokenizerInfo(
            [bytes([i]) for i in range(min(256, vocab_size))],
            xgrammar.VocabType.RAW,
            vocab_size=vocab_size,
            stop_token_ids=stop,
        )
    if isinstance(tokenizer, HFTokenizer):
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer.backend, vocab_size=vocab_size, stop_token_ids=stop)
    raise TypeError(f"structured output needs a ByteTokenizer or an HFTokenizer (got {type(tokenizer).__name__})")


#: the byte ranges that must follow a UTF-8 lead byte (RFC 3629's table: no overlong forms, no
#: surrogates U+D800..U+DFFF, nothing beyond U+10FFFF)
_CONTINUATION = (0x80, 0xBF)
_UTF8_FOLLOWERS: dict[int, tuple[tuple[int, int], ...]] = {
    **{lead: (_CONTINUATION,) for lead in range(0xC2, 0xE0)},
    0xE0: ((0xA0, 0xBF), _CONTINUATION),
    **{lead: (_CONTINUATION, _CONTINUATION) for lead in [*range(0xE1, 0xED), 0xEE, 0xEF]},
    0xED: ((0x80, 0x9F), _CONTINUATION),
    0xF0: ((0x90, 0xBF), _CONTINUATION, _CONTINUATION),
    **{lead: (_CONTINUATION, _CONTINUATION, _CONTINUATION) for lead in range(0xF1, 0xF4)},
    0xF4: ((0x80, 0x8F), _CONTINUATION, _CONTINUATION),
}
#: every byte range a UTF-8 character may need next, in a fixed order (rows of the byte masks)
_UTF8_RANGES = sorted({byte_range for followers in _UTF8_FOLLOWERS.values() for byte_range in followers})


class _Constrained:
    """One request's matcher, whether its output is finished (a stop token accepted, the
    grammar complete with nothing but a stop token to follow, or, without stop tokens, the
    grammar complete), and, on a byte vocabulary, the byte ranges the UTF-8 character it is
    in the middle of still needs (xgrammar's byte-level matching lets UTF-8-encoded surrogates
    through, which no decoder accepts)."""

    __slots__ = ("done", "matcher", "utf8_pending")

    def __init__(self, matcher: xgrammar.GrammarMatcher):
        self.matcher = matcher
        self.done = False
        self.utf8_pending: tuple[tuple[int, int], ...] = ()


class StructuredOutputs:
    """Owns one model vocabulary's grammar compiler (built with the first grammar, from the
    model's tokenizer), the grammars compiled for it (cached by their ``StructuredOutput``, at
    most ``MAX_CACHED_GRAMMARS``), and one matcher per constrained request.

    Invariants: a request's matcher has accepted exactly the tokens the request generated (the
    engine calls ``accept`` with each, in order); ``mask`` never changes a matcher; a request is
    known from ``add`` until ``forget``."""

    def __init__(
        self, tokenizer: Callable[[], Tokenizer], vocab_size: int, eos_token_ids: Sequence[int], *, threads: int = 1
    ):
        """``tokenizer`` builds the model's tokenizer; it is called once, when the first grammar
        is compiled (an engine that never sees a constrained request never loads it).
        ``vocab_size``: the model's (its logits' width); ``eos_token_ids`` end a complete output."""
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._tokenizer = tokenizer
        self._threads = max(1, threads)
        # without a stop token the only way to end is to stop at the first whole match
        self._terminate_when_complete = not self.stop_token_ids
        # built with the first grammar (``compiled``), like the compiler
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._grammars: dict[StructuredOutput, xgrammar.CompiledGrammar] = {}
        self._requests: dict[str, _Constrained] = {}
        # ids are bytes (a ByteTokenizer): each sample is also kept valid UTF-8 (``_Constrained``)
        self._byte_vocabulary = False
        # row r: the bytes allowed where a character needs a byte of ``_UTF8_RANGES[r]``
        self._utf8_masks = np.zeros((len(_UTF8_RANGES), vocab_size), dtype=np.bool_)
        for row, (low, high) in enumerate(_UTF8_RANGES):
            self._utf8_masks[row, low : min(high + 1, vocab_size)] = True
        self._words = (vocab_size + 31) // 32
        self._bitmask = torch.full((1, self._words), -1, dtype=torch.int32)
        # every real token but the stop tokens, as bitmask words: "may anything else follow?"
        not_stop = np.zeros(self._words * 32, dtype=np.uint8)
        not_stop[:vocab_size] = 1
        not_stop[list(self.stop_token_ids)] = 0
        self._not_stop = np.packbits(not_stop, bitorder="little").view(np.int32)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def compiled(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The spec's grammar compiled for this vocabulary (cached). ValueError if the spec is
        bad (entry points refuse those first, ``validate_structured``)."""
        grammar = self._grammars.get(structured)
        if grammar is None:
            if self._compiler is None:
                xgrammar = load_xgrammar()

                tokenizer = self._tokenizer()
                self._byte_vocabulary = isinstance(tokenizer, ByteTokenizer)
                info = tokenizer_info(tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._threads)
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=self._threads)
            grammar = self._compiler.compile_grammar(grammar_of(structured))
            if len(self._grammars) >= MAX_CACHED_GRAMMARS:
                del self._grammars[next(iter(self._grammars))]
            self._grammars[structured] = grammar
        return grammar

    def add(self, request_id: str, structured: StructuredOutput, output_token_ids: Sequence[int] = ()) -> None:
        """Constrain a request from its first generated token on; ``output_token_ids``: the
        tokens a resumed request generated already (ValueError if the grammar refuses one)."""
        xgrammar = load_xgrammar()

        matcher = xgrammar.GrammarMatcher(
            self.compiled(structured), terminate_without_stop_token=self._terminate_when_complete
        )
        self._requests[request_id] = _Constrained(matcher)
        for position, token in enumerate(output_token_ids):
            if not self.accept(request_id, token):
                del self._requests[request_id]
                where = f"token {token} at position {position}"
                raise ValueError(f"output_token_ids: {where} does not fit the request's {structured.kind}")

    def forget(self, request_id: str) -> None:
        """Drop a request's matcher (finished, aborted, failed); unknown ids are ignored."""
        self._requests.pop(request_id, None)

    def mask(self, request_ids: Sequence[str]) -> torch.Tensor | None:
        """The tokens each row may sample next: bool ``[len(request_ids), vocab_size]`` on the
        CPU, True = allowed; a row of an unconstrained request is all True. None when no row is
        constrained (nothing to mask)."""
        rows: list[int] = []
        matchers: list[xgrammar.GrammarMatcher] = []
        mid_character: list[tuple[int, int]] = []  # (row, its byte range's index in _UTF8_RANGES)
        for row, request_id in enumerate(request_ids):
            constrained = self._requests.get(request_id)
            if constrained is not None:
                rows.append(row)
                matchers.append(constrained.matcher)
                if constrained.utf8_pending:
                    mid_character.append((row, _UTF8_RANGES.index(constrained.utf8_pending[0])))
        if not rows:
            return None
        bitmask = self._bitmask_rows(len(request_ids))
        bitmask.fill_(-1)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            assert self._batch is not None  # built with the compiler each matcher's grammar came from
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        # bit b of word w is token 32 w + b: little-endian bytes unpack least significant bit first
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        allowed = bits.view(np.bool_)
        if mid_character:
            at_rows, ranges = zip(*mid_character, strict=True)
            allowed[list(at_rows)] &= self._utf8_masks[list(ranges)]
        return torch.from_numpy(allowed)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its sampled token; False if the grammar refuses it
        (a sampler that ignored the mask). Unconstrained requests accept anything."""
        constrained = self._requests.get(request_id)
        if constrained is None:
            return True
        matcher = constrained.matcher
        if not matcher.accept_token(token_id):
            return False
        if self._byte_vocabulary:
            pending = constrained.utf8_pending
            constrained.utf8_pending = pending[1:] if pending else _UTF8_FOLLOWERS.get(token_id, ())
        if matcher.is_terminated():
            constrained.done = True
        elif matcher.is_completed():
            constrained.done = not self._may_continue(matcher)
        return True

    def is_terminated(self, request_id: str) -> bool:
        """Whether the request's output is finished (the engine stops it with ``stop``)."""
        constrained = self._requests.get(request_id)
        return constrained is not None and constrained.done

    def _may_continue(self, matcher: xgrammar.GrammarMatcher) -> bool:
        """Whether any token but a stop token may follow (the matcher's output is complete)."""
        row = self._bitmask[:1]
        matcher.fill_next_token_bitmask(row, 0)
        return bool(np.any(row.numpy()[0] & self._not_stop))

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the reused int32 bitmask (grown as needed)."""
        if self._bitmask.shape[0] < rows:
            self._bitmask = torch.full((max(rows, 2 * self._bitmask.shape[0]), self._words), -1, dtype=torch.int32)
        return self._bitmask[:rows]
