"""Checks of request inputs at the edge, with messages that name the field and the value.

Each entry point (the HTTP ingress, the CLI and the job, the driver API ``Cluster``, the offline
``LLM``) checks a request once with these rules and hands a ``ValidatedPrompt`` inward; the layers
behind it (the request runner, the worker actors, ``EngineCore``, the scheduler) only assert.

Every message has the form ``"<field>: <what is wrong> (got <value!r>)"``, the same as the
configuration's (``configs.load``) and the HTTP API's, and every failure is an
``InvalidRequestError``: a ``ValueError`` whose ``str()`` is one such line per problem.
Pure Python: no torch, no ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from configs.load import VALIDATION_MESSAGES

#: the shared table, plus the one pydantic error type a request can hit and a config cannot

REPR_LIMIT = 80


class InvalidRequestError(ValueError):
    """A request that cannot run; ``str(err)`` names each bad field and its value, one per line."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class ValidatedPrompt:
    """A prompt that passed every check of its entry point against one served model: its token
    ids, the user's text when the prompt was given as text (None for token ids: nothing decodes
    them back), and its cache salt.

    Invariants: ``token_ids`` is non-empty, each id lies in the model's vocabulary, and there are
    fewer than its ``max_model_len`` (room to generate); ``cache_salt`` is None or a non-empty
    string. Only the entry points build one (``validate_prompt``, the HTTP ingress)."""

    token_ids: tuple[int, ...]
    text: str | None = None
    cache_salt: str | None = None


def short_repr(value: Any, limit: int = REPR_LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters (a prompt of 10,000 token ids stays readable)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problem(field: str, message: str, value: Any) -> str:
    """One line: ``"<field>: <message> (got <value!r>)"``."""
    return f"{field}: {message} (got {short_repr(value)})"


def describe_validation_error(error: ValidationError) -> list[str]:
    """Each problem of a failed pydantic validation as one field-named line."""
    lines = []
    for item in error.errors(include_url=False):
        field = _field_path(item["loc"])
        template = VALIDATION_MESSAGES.get(item["type"])
        if template is not None:
            message = template.format(**(item.get("ctx") or {}))
        else:  # a validator's own ValueError
            message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "missing" or "(got " in message:
            lines.append(f"{field}: {message}")
        else:
            lines.append(problem(field, message, item.get("input")))
    return lines


def check_prompt(prompt: object, vocab_size: int | None = None, field: str = "prompt") -> str | list[int]:
    """The checks that need no tokenizer: non-empty text, or a non-empty list (or tuple) of
    integer token ids in ``[0, vocab_size)`` (``>= 0`` when ``vocab_size`` is None). Returns the
    text, or the token ids as a list."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError(problem(field, "must not be empty", prompt))
        return prompt
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequestError(problem(field, "must be text or a list of token ids", prompt))
    if not prompt:
        raise InvalidRequestError(problem(field, "must not be empty", prompt))
    return check_token_ids(prompt, vocab_size, field)


def check_token_ids(ids: object, vocab_size: int | None, field: str = "prompt") -> list[int]:
    """``ids`` as a list, each an integer in ``[0, vocab_size)`` (``>= 0`` when ``vocab_size`` is
    None); an empty list passes (the caller decides whether empty is allowed)."""
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError(problem(field, "must be text or a list of token ids", ids))
    token_ids = list(ids)
    for position, token in enumerate(token_ids):
        where = f"position {position} of {len(token_ids)}"
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidRequestError(f"{field}: token id {short_repr(token)} is not an integer ({where})")
        if vocab_size is not None and not in_vocabulary(token, vocab_size):
            raise InvalidRequestError(
                f"{field}: token id {token} is outside the vocabulary [0, {vocab_size}) ({where})"
            )
        if token < 0:
            raise InvalidRequestError(f"{field}: token id {token} is negative ({where})")
    return token_ids


def in_vocabulary(token: int, vocab_size: int) -> bool:
    """The vocabulary rule: a token id lies in ``[0, vocab_size)``."""
    return 0 <= token < vocab_size


def leaves_room(num_prompt_tokens: int, max_model_len: int) -> bool:
    """The context-length rule: a prompt leaves at least one position to generate into."""
    return num_prompt_tokens < max_model_len


def check_room(num_prompt_tokens: int, max_model_len: int) -> None:
    """``leaves_room``, as an InvalidRequestError naming the prompt's length."""
    if not leaves_room(num_prompt_tokens, max_model_len):
        raise InvalidRequestError(
            f"prompt: {num_prompt_tokens} tokens leave no room to generate within "
            f"max_model_len={max_model_len} (got a prompt of {num_prompt_tokens} tokens)"
        )


def check_cache_salt(cache_salt: object, field: str = "cache_salt") -> str | None:
    """A cache salt: None (no salt), or a non-empty string that every block hash of the prompt
    depends on (through its first block), so requests share cached blocks only with requests of
    the same salt."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError(problem(field, "must be a non-empty string", cache_salt))
    return cache_salt


def validate_prompt(
    prompt: object,
    vocab_size: int,
    max_model_len: int,
    encode: Callable[[str], Sequence[int]],
    cache_salt: object = None,
) -> ValidatedPrompt:
    """Every check a prompt gets, once, at its entry point: text or token ids (``check_prompt``),
    text that encodes to at least one token, room to generate (``check_room``) and the cache
    salt (``check_cache_salt``). Raises InvalidRequestError naming the field and the value."""
    salt = check_cache_salt(cache_salt)
    checked = check_prompt(prompt, vocab_size)
    if isinstance(checked, str):
        token_ids = list(encode(checked))  # transformers tokenizers add BOS themselves
        if not token_ids:
            raise InvalidRequestError(problem("prompt", "encodes to no tokens", checked))
        text: str | None = checked
    else:
        token_ids, text = checked, None
    check_room(len(token_ids), max_model_len)
    return ValidatedPrompt(tuple(token_ids), text, salt)


def check_request_id(request_id: object, field: str = "request_id") -> str:
    """A request id: a non-empty string."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(problem(field, "must be a non-empty string", request_id))
    return request_id


def prompt_batch(prompts: object) -> list[object]:
    """``prompts`` as a list of prompts: one text, or one list of token ids (a list whose first
    item is an integer), is a batch of one; any other list or tuple is the batch itself; anything
    else is a batch of one bad prompt, for ``check_prompt`` to name."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        first_is_token = bool(prompts) and isinstance(prompts[0], int) and not isinstance(prompts[0], bool)
        return [prompts] if first_is_token else list(prompts)
    return [prompts]


def _field_path(loc: Sequence[Any]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "sampling"
