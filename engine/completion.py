"""What a finished request hands back (``engine.llm.LLM.generate``, and the drivers' results
built on it in ``cluster.results``). No torch here: the drivers and the HTTP ingress use it
without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass

from engine.logprobs import TokenLogprob


@dataclass(frozen=True)
class Completion:
    """One finished request: its text, the generated token ids and why it stopped; with the
    sampling's ``logprobs`` one ``TokenLogprob`` per generated token, with ``prompt_logprobs``
    one per prompt token (None for the first), else None."""

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
