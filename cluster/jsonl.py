"""JSONL in and out for the CLI and the job entrypoint.

Input: one object per line with ``prompt`` (text, or a list of token ids) and optionally ``id``
and per-request sampling fields (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``,
``stop``, ``ignore_eos``). Output: one object per request, in input order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from engine.sampling_params import SamplingParams

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos")


@dataclass(frozen=True)
class PromptItem:
    """One input line: the prompt, its id (if given) and its sampling parameters."""

    prompt: str | list[int]
    sampling: SamplingParams
    id: str | None = None


def check_prompt(prompt: object) -> None:
    """The checks that need no tokenizer: text or token ids, and not empty."""
    if not isinstance(prompt, (str, list)) or (
        isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise ValueError(f"prompt: must be text or a list of token ids (got {prompt!r})")
    if not prompt:
        raise ValueError(f"prompt: must not be empty (got {prompt!r})")


def read_prompts(path: str | Path, defaults: SamplingParams) -> list[PromptItem]:
    """Parse a JSONL file; raises ValueError naming the line and the field for a bad line."""
    items: list[PromptItem] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise ValueError(f"{where}: expected an object with a 'prompt' field (got {line.strip()[:80]!r})")
            prompt = record["prompt"]
            try:
                check_prompt(prompt)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            updates = {k: record[k] for k in SAMPLING_FIELDS if k in record}
            if "stop" in updates and isinstance(updates["stop"], str):
                updates["stop"] = (updates["stop"],)
            try:
                sampling = defaults.replace(**updates)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}: {exc}") from None
            request_id = record.get("id")
            items.append(PromptItem(prompt, sampling, None if request_id is None else str(request_id)))
    return items


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
    return record


def write_results(out: IO[str], ids: Sequence[str | None], completions: Iterable[Any]) -> None:
    for item_id, completion in zip(ids, completions, strict=True):
        out.write(json.dumps(result_record(item_id, completion), ensure_ascii=False) + "\n")
    out.flush()
