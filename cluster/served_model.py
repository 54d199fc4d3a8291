"""The model a started cluster serves, as the driver knows it from its workers' reports: the
tokenizer, the vocabulary, the context length and the block size prompts are hashed with. The
driver API checks every prompt against it once, at its entry point (``check_prompt``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.validation import ValidatedPrompt, check_token_ids, validate_prompt

if TYPE_CHECKING:
    from actors.worker_types import WorkerInfo
    from engine.tokenizer import Tokenizer


def same_kv_layout(a: WorkerInfo, b: WorkerInfo) -> bool:
    """Whether two workers lay out KV alike (the same groups and block size), so a prefix
    cached on one is the same prefix on the other and a transfer between them is valid."""
    return a.groups == b.groups and a.block_size == b.block_size


@dataclass(frozen=True)
class ServedModel:
    """What every worker of the cluster agrees on: its model directory, the tokenizer loaded
    from it, the vocabulary size, the shortest ``max_model_len`` among the workers, the block
    size of the prefix hashes (``engine.kv_cache.spec.hash_block_size``) and the end-of-sequence
    token.

    Invariants: built only from workers that share one KV layout; ``max_model_len`` bounds a
    prompt on every worker."""

    directory: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    hash_block_size: int
    eos_token_id: int | None = None  # ends a request unless it ignores EOS (``engine.request.stop_status``)

    @classmethod
    def from_workers(cls, infos: Mapping[str, WorkerInfo], directory: str) -> ServedModel:
        """The started workers' reports as one model; raises RuntimeError naming a worker whose
        KV layout differs from the first's."""
        from engine.kv_cache.spec import hash_block_size
        from engine.tokenizer import load_tokenizer

        first = next(iter(infos.values()))
        for info in infos.values():
            if not same_kv_layout(info, first):
                raise RuntimeError(f"{info.worker_id}: KV layout differs from {first.worker_id}'s")
        return cls(
            directory=directory,
            tokenizer=load_tokenizer(Path(directory), first.vocab_size),
            vocab_size=first.vocab_size,
            max_model_len=min(info.max_model_len for info in infos.values()),
            hash_block_size=hash_block_size(list(first.groups)),
            eos_token_id=first.eos_token_id,
        )

    def check_ids(self, name: str, ids: Sequence[int]) -> list[int]:
        """Token ids as a list after checking each lies in the vocabulary (ValueError naming
        ``name`` and the value otherwise)."""
        return check_token_ids(ids, self.vocab_size, name)

    def check_prompt(self, prompt: object, cache_salt: object = None) -> ValidatedPrompt:
        """A prompt (text, or a list of token ids) and its cache salt, checked against this model
        once (``engine.validation.validate_prompt``); raises ValueError naming the field and the
        value for an empty prompt, a wrong type, a token id outside the vocabulary, a prompt of
        max_model_len tokens or more, or an empty cache salt."""
        return validate_prompt(prompt, self.vocab_size, self.max_model_len, self.tokenizer.encode, cache_salt)

    def prompt_text(self, prompt: ValidatedPrompt) -> str:
        """The prompt as text: the user's own text, or its token ids decoded."""
        return prompt.text if prompt.text is not None else self.tokenizer.decode(list(prompt.token_ids))
