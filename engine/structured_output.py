"""Structured output: a request's ``StructuredOutput`` (``engine.sampling_params``) as a grammar,
applied while sampling as a mask of the tokens that keep the output inside that grammar.

The grammars are xgrammar's: ``grammar_of`` turns a spec into an ``xgrammar.Grammar`` (no
tokenizer needed: the entry points check a spec with it once, ``validate_structured``), and
``StructuredOutputs`` compiles it against one model's vocabulary and walks one matcher per
request as its tokens are sampled.

JSON (``json_object``, ``json_schema``) is generated compact (``", "`` and ``": "`` between
items, no other whitespace): a model never wanders into runs of blanks, and every output that
ends ends with its last closing bracket.

When a request's grammar is complete:
- the model has an end-of-sequence token: the mask allows it where the grammar may end, and the
  request stops when it is sampled, or at once when nothing but it may follow (no extra step,
  and no end-of-sequence token in the output);
- the model has none (a tiny random byte model): the request stops the first time the output
  is a whole match of the grammar.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence

import numpy as np
import torch
import xgrammar

from engine.sampling_params import StructuredOutput
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from engine.validation import InvalidRequestError, problem

log = logging.getLogger(__name__)

#: compiled grammars kept per engine (the oldest is dropped beyond this many)
MAX_CACHED_GRAMMARS = 256
#: the location prefix of xgrammar's messages, e.g. ``[01:28:48] /project/cpp/regex_converter.cc:83: ``
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: \(.*?\) is false: )?")


def _native_message(exc: Exception) -> str:
    """xgrammar's error without its source location: what is wrong with the spec."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _NATIVE_PREFIX.sub("", text)


def _choices(spec: str) -> list[str]:
    """A ``choice`` spec: a JSON list of one or more strings (ValueError otherwise)."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON list of strings ({exc.msg})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("must be a JSON list of one or more non-empty strings")
    return choices


def _json_schema_text(spec: str) -> str:
    """A ``json_schema`` spec: JSON text of an object (ValueError otherwise)."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON Schema as JSON text ({exc.msg})") from None
    if not isinstance(schema, dict):
        raise ValueError("must be a JSON Schema object")  # noqa: TRY004 - a bad spec is a ValueError (grammar_of)
    return spec


def grammar_of(structured: StructuredOutput) -> xgrammar.Grammar:
    """The grammar a spec stands for (the one place each kind's rule lives). Raises ValueError
    saying what is wrong with ``structured.spec``."""
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json_object":
            if spec.strip():
                raise ValueError("must be empty for json_object (any JSON object)")
            # strict_mode=False: an object schema without properties admits any members
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "json_schema":
            return xgrammar.Grammar.from_json_schema(_json_schema_text(spec), any_whitespace=False)
        if kind == "regex":
            if not spec:
                raise ValueError("must be a non-empty regular expression")
            return xgrammar.Grammar.from_regex(spec)
        if kind == "grammar":
            if not spec.strip():
                raise ValueError("must be a non-empty EBNF grammar (root rule: root)")
            return xgrammar.Grammar.from_ebnf(spec)
        # choice: one rule, an alternative per string (JSON string escapes are EBNF's too)
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=True) for choice in _choices(spec))
        return xgrammar.Grammar.from_ebnf(f"root ::= {alternatives}")
    except RuntimeError as exc:  # xgrammar's parsers and converters raise RuntimeError
        raise ValueError(_native_message(exc)) from None


def validate_structured(structured: object, field: str = "structured") -> StructuredOutput | None:
    """The entry points' one check of a structured-output spec: None, or a StructuredOutput
    whose spec makes a grammar (a schema that converts, a regex that parses, a grammar with a
    ``root`` rule, a non-empty list of choices). Raises InvalidRequestError naming
    ``<field>.spec`` and the value, e.g. ``structured.spec: Unsupported type "nope" (got ...)``."""
    if structured is None:
        return None
    if not isinstance(structured, StructuredOutput):
        raise InvalidRequestError(problem(field, "must be a StructuredOutput", structured))
    try:
        grammar_of(structured)
    except ValueError as exc:
        message = f"not a valid {structured.kind}: {exc}"
        raise InvalidRequestError(problem(f"{field}.spec", message, structured.spec)) from None
    return structured


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    """The vocabulary as xgrammar sees it: ``vocab_size`` is the model's (its logits' width);
    ids the tokenizer does not have are never allowed. ``eos_token_ids`` end a complete output."""
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


class _Constrained:
    """One request's matcher and whether its output is finished (a stop token accepted, the
    grammar complete with nothing but a stop token to follow, or, without stop tokens, the
    grammar complete)."""

    __slots__ = ("done", "matcher")

    def __init__(self, matcher: xgrammar.GrammarMatcher):
        self.matcher = matcher
        self.done = False


class StructuredOutputs:
    """Owns one model vocabulary's grammar compiler, the grammars compiled for it (cached by
    their ``StructuredOutput``, at most ``MAX_CACHED_GRAMMARS``), and one matcher per
    constrained request.

    Invariants: a request's matcher has accepted exactly the tokens the request generated (the
    engine calls ``accept`` with each, in order); ``mask`` never changes a matcher; a request is
    known from ``add`` until ``forget``."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *, threads: int = 1):
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        self.stop_token_ids = tuple(self.info.stop_token_ids)
        # without a stop token the only way to end is to stop at the first whole match
        self._terminate_when_complete = not self.stop_token_ids
        self._compiler = xgrammar.GrammarCompiler(self.info, max_threads=max(1, threads))
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=max(1, threads))
        self._grammars: dict[StructuredOutput, xgrammar.CompiledGrammar] = {}
        self._requests: dict[str, _Constrained] = {}
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
            grammar = self._compiler.compile_grammar(grammar_of(structured))
            if len(self._grammars) >= MAX_CACHED_GRAMMARS:
                del self._grammars[next(iter(self._grammars))]
            self._grammars[structured] = grammar
        return grammar

    def add(self, request_id: str, structured: StructuredOutput) -> None:
        """Constrain a request from its first generated token on."""
        matcher = xgrammar.GrammarMatcher(
            self.compiled(structured), terminate_without_stop_token=self._terminate_when_complete
        )
        self._requests[request_id] = _Constrained(matcher)

    def forget(self, request_id: str) -> None:
        """Drop a request's matcher (finished, aborted, failed); unknown ids are ignored."""
        self._requests.pop(request_id, None)

    def mask(self, request_ids: Sequence[str]) -> torch.Tensor | None:
        """The tokens each row may sample next: bool ``[len(request_ids), vocab_size]`` on the
        CPU, True = allowed; a row of an unconstrained request is all True. None when no row is
        constrained (nothing to mask)."""
        rows: list[int] = []
        matchers: list[xgrammar.GrammarMatcher] = []
        for row, request_id in enumerate(request_ids):
            constrained = self._requests.get(request_id)
            if constrained is not None:
                rows.append(row)
                matchers.append(constrained.matcher)
        if not rows:
            return None
        bitmask = self._bitmask_rows(len(request_ids))
        bitmask.fill_(-1)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        # bit b of word w is token 32 w + b: little-endian bytes unpack least significant bit first
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, : self.vocab_size].view(np.bool_))

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its sampled token; False if the grammar refuses it
        (a sampler that ignored the mask). Unconstrained requests accept anything."""
        constrained = self._requests.get(request_id)
        if constrained is None:
            return True
        matcher = constrained.matcher
        if not matcher.accept_token(token_id):
            return False
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
