"""A request inside one engine: prompt, generated tokens, status and stop checks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from enum import Enum

from engine.kv_cache.request import CacheRequest
from engine.sampling_params import SamplingParams


class UncheckedRequestError(RuntimeError):
    """A request reached an engine without passing its entry point's checks (an empty prompt,
    no room to generate, an id the engine holds already). Always an internal error: every entry
    point (the driver API, the HTTP ingress, the CLI, ``engine.llm.LLM``) validates a request
    once with ``engine.validation``, and the engine only asserts what its bookkeeping needs."""


class RequestStatus(str, Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated, a transfer is writing the prompt's KV
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_REMOTE_DECODE = "remote_decode"  # prefill-only: KV computed, blocks held for a reader

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
    RequestStatus.FINISHED_REMOTE_DECODE,
}


class Request(CacheRequest):
    """Prompt + output tokens (``token_ids`` holds both, hashed block by block as it grows).

    ``num_computed_tokens`` counts tokens whose KV exists or is being computed in the current
    step; it returns to 0 on preemption (recompute). ``num_external_tokens`` is set while the
    prompt's KV is being transferred in. A ``prefill_only`` request (prefill side of P/D) computes
    its tokens' KV, samples nothing and finishes with its blocks still held for a reader.
    ``scheduled_at`` / ``kv_loaded_at`` (this process's monotonic clock) time its hops.
    ``chunk_stop`` (hybrid models, set at each admission) is a block boundary a prefill chunk must
    end at so that a recurrent state is cached there (``scheduler.recurrent_checkpoint``), else 0.
    A resumed request (``output_token_ids`` given: tokens generated elsewhere) starts with them
    after its prompt; they count as outputs (``max_tokens``, penalties, the seeded draw index).
    """

    __slots__ = (
        "arrival_time",
        "chunk_stop",
        "eos_token_id",
        "kv_loaded_at",
        "num_cached_tokens",
        "num_external_tokens",
        "num_host_cached_tokens",
        "num_preemptions",
        "prefill_only",
        "prompt_len",
        "sampling",
        "scheduled_at",
        "status",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        hash_block_size: int,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        remote_prefill: bool = False,
        prefill_only: bool = False,
        output_token_ids: Sequence[int] = (),
    ):
        if not prompt_token_ids:
            raise UncheckedRequestError(f"request {request_id!r}: an empty prompt reached the engine")
        if len(output_token_ids) >= sampling.max_tokens:
            raise UncheckedRequestError(
                f"request {request_id!r}: resumed with {len(output_token_ids)} output tokens, "
                f"max_tokens={sampling.max_tokens} leaves none to generate"
            )
        tokens = [*prompt_token_ids, *output_token_ids]
        super().__init__(request_id, tokens, hash_block_size, cache_salt, remote_prefill)
        self.prompt_len = len(prompt_token_ids)
        self.sampling = sampling
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic()
        self.eos_token_id = eos_token_id
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # hit + external tokens at first admission
        self.num_host_cached_tokens = 0  # the part of the hit the host tier served (at first admission)
        self.num_external_tokens = 0
        self.chunk_stop = 0
        self.stop_reason: int | str | None = None
        self.prefill_only = prefill_only
        self.scheduled_at: float | None = None  # first admission (computing, or blocks for a transfer)
        self.kv_loaded_at: float | None = None  # its transferred KV arrived (remote prefill)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt logprobs are still to be reported (``prompt_logprobs``, no output
        yet): every prompt position is computed then, so it takes no prefix hit at admission."""
        return self.sampling.prompt_logprobs is not None and len(self.token_ids) == self.prompt_len

    def check_stop_token(self, token_id: int) -> RequestStatus | None:
        """Finish status after appending ``token_id`` (``stop_status``)."""
        status = stop_status(self.sampling, token_id, self.num_output_tokens, self.eos_token_id)
        if status is RequestStatus.FINISHED_STOPPED:
            self.stop_reason = token_id
        return status


def stop_status(
    sampling: SamplingParams, last_token: int, num_output_tokens: int, eos_token_id: int | None
) -> RequestStatus | None:
    """The engine's stop rule for an output whose last token is ``last_token``: stopped by the
    end-of-sequence token (unless ``ignore_eos``) or a stop token, else length-finished at
    ``max_tokens``, else not finished. Stop strings are the detokenizer's
    (``engine.tokenizer.IncrementalDetokenizer``)."""
    if (not sampling.ignore_eos and last_token == eos_token_id) or last_token in sampling.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= sampling.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
