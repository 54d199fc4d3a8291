"""JSONL in and out for the CLI (``kvfleet generate --input``) and the job entrypoint.

Input: one object per line with ``prompt`` (text, or a list of token ids) and optionally ``id``
(a string or an integer), ``cache_salt`` (a non-empty string: the line's prompt reuses cached
blocks only of requests with the same salt) and per-request sampling fields (``max_tokens``, ``temperature``,
``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``, ``ignore_eos``, ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``logit_bias`` (token id -> bias), ``logprobs`` and
``prompt_logprobs`` (how many top alternatives per position, 0..20) and ``structured`` (``{"kind":
"json_schema", "spec": "<schema as JSON text>"}``, or kind ``json_object`` / ``regex`` / ``grammar``
/ ``choice``: the output is constrained to it), as ``SamplingParams`` takes them); any other
key is refused (a typo must not silently fall back to a default). Blank lines are skipped.

A bad line does not stop the run: it becomes a ``LineError``, reported as
``<file>:<line>: <field>: <what is wrong> (got <value>)``, and the good lines still run.

Output: one object per non-blank input line, in input order. A line that ran gives
``{"id"?, "prompt", "text", "token_ids", "finish_reason", "prefill_worker", "decode_worker",
"cached_tokens", "ttft_s"}``, plus ``"logprobs"`` (one ``{"token_id", "logprob", "rank", "top":
[[token_id, logprob], ...]}`` per token of ``token_ids``) when the line asked for ``logprobs``
and ``"prompt_logprobs"`` (one per prompt token, null for the first) when it asked for
``prompt_logprobs``; a bad line gives an error record
``{"id"?, "line": <line number>, "error": "<field>: <what is wrong> (got <value>)"}`` (``id``
when the line had a usable one), so nothing is dropped silently: a record is an error record
exactly when it has an ``error`` key. The CLI and the job exit with ``EXIT_PARTIAL`` (3) when
any line failed (see ``kvfleet.cli``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured_spec import validate_structured
from engine.validation import InvalidRequestError, ValidatedPrompt, check_cache_salt, check_prompt, problem

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "prompt_logprobs",
    "structured",
)
LINE_FIELDS = ("prompt", "id", "cache_salt", *SAMPLING_FIELDS)


@dataclass(frozen=True)
class PromptItem:
    """One prompt to run: the prompt (a ``ValidatedPrompt`` once the started cluster checked it,
    ``checked``), its sampling parameters, its id (if given), its cache salt (if given) and, for a
    JSONL line, the file and line it came from (None for a prompt given on the command line)."""

    prompt: str | list[int] | ValidatedPrompt
    sampling: SamplingParams
    id: str | None = None
    path: str | None = None
    line: int | None = None
    cache_salt: str | None = None

    def checked(self, prompt: ValidatedPrompt) -> PromptItem:
        """This item with its prompt as the cluster checked it (run as it is, not checked again)."""
        return replace(self, prompt=prompt)

    def rejected(self, message: str) -> LineError:
        """This JSONL line as a failed one (e.g. a prompt longer than the model's context)."""
        assert self.path is not None and self.line is not None, "only a JSONL line becomes a LineError"
        return LineError(self.path, self.line, message, self.id)


@dataclass(frozen=True)
class LineError:
    """A JSONL line that cannot run: where it is, the field-named message, its id if readable."""

    path: str
    line: int
    message: str
    id: str | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"

    def record(self) -> dict[str, Any]:
        """The error record written to the output in this line's place."""
        record: dict[str, Any] = {} if self.id is None else {"id": self.id}
        record.update(line=self.line, error=self.message)
        return record


def read_prompts(path: str | Path, defaults: SamplingParams) -> list[PromptItem | LineError]:
    """Every non-blank line of a JSONL file, in order: a PromptItem, or a LineError naming the
    field and the value. Raises OSError only when the file itself cannot be read."""
    entries: list[PromptItem | LineError] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                entries.append(parse_line(raw, defaults, str(path), number))
            except InvalidRequestError as exc:
                entries.append(LineError(str(path), number, "; ".join(exc.problems), _readable_id(raw)))
    return entries


def parse_line(raw: bytes, defaults: SamplingParams, path: str, number: int) -> PromptItem:
    """One JSONL line as a PromptItem; InvalidRequestError naming the field for a bad one."""
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"line: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"line: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise InvalidRequestError(problem("line", 'must be a JSON object with a "prompt" field', record))
    unknown = [key for key in record if key not in LINE_FIELDS]
    if unknown:
        raise InvalidRequestError([problem(key, "unknown field", record[key]) for key in unknown])
    if "prompt" not in record:
        raise InvalidRequestError("prompt: required field is missing")
    request_id = _line_id(record.get("id"))
    prompt = check_prompt(record["prompt"])
    cache_salt = check_cache_salt(record.get("cache_salt"))
    updates = {key: record[key] for key in SAMPLING_FIELDS if key in record}
    sampling = defaults.replace(**updates) if updates else defaults
    validate_structured(sampling.structured)
    return PromptItem(prompt, sampling, request_id, path, number, cache_salt)


def result_record(item_id: str | None, completion: Any) -> dict[str, Any]:
    """The output object of one finished request."""
    record: dict[str, Any] = {}
    if item_id is not None:
        record["id"] = item_id
    record.update(
        prompt=completion.prompt,
        text=completion.text,
        token_ids=list(completion.token_ids),
        finish_reason=completion.finish_reason,
    )
    for name in ("prefill_worker", "decode_worker", "cached_tokens", "ttft_s"):
        if hasattr(completion, name):
            record[name] = getattr(completion, name)
    logprobs = getattr(completion, "logprobs", None)
    if logprobs is not None:
        record["logprobs"] = [logprob_record(entry) for entry in logprobs]
    prompt_logprobs = getattr(completion, "prompt_logprobs", None)
    if prompt_logprobs is not None:
        record["prompt_logprobs"] = [None if entry is None else logprob_record(entry) for entry in prompt_logprobs]
    return record


def logprob_record(entry: TokenLogprob) -> dict[str, Any]:
    """One position's logprob as JSON: ``{"token_id", "logprob", "rank", "top": [[id, logprob], ...]}``."""
    return {
        "token_id": entry.token_id,
        "logprob": entry.logprob,
        "rank": entry.rank,
        "top": [[token_id, logprob] for token_id, logprob in entry.top],
    }


def write_records(out: IO[str], records: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line."""
    for record in records:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()


def _line_id(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidRequestError(problem("id", "must be a string or an integer", value))
    return str(value)


def _readable_id(raw: bytes) -> str | None:
    """The id of a bad line when it has a usable one, so its error record can carry it."""
    try:
        record = json.loads(raw)
        return _line_id(record.get("id")) if isinstance(record, dict) else None
    except ValueError:  # not JSON, or an unusable id
        return None
