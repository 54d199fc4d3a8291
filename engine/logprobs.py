"""Log-probabilities the engine reports per token (OpenAI's ``logprobs`` / ``top_logprobs`` and
the prompt logprobs behind ``echo``).

A logprob is the log-softmax of the model's raw logits at that position (before temperature,
penalties, ``logit_bias`` or a structured-output mask), in float32, as Hugging Face's
``log_softmax(logits)`` gives it. ``rank`` is the token's 1-based rank in that distribution
(1: the argmax). ``top`` holds the ``k`` most likely tokens, most likely first, where the
request asked for ``k`` top logprobs (``SamplingParams.logprobs`` / ``prompt_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's logprob: the token chosen (sampled, or the prompt's next token), its
    logprob and rank, and the ``top`` alternatives as ``(token_id, logprob)`` pairs."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
