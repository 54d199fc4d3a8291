"""Offline API: ``LLM(config).generate(prompts, sampling)`` on one in-process EngineCore."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from configs import ClusterConfig, load_config
from engine.completion import Completion
from engine.core import EngineCore
from engine.logprobs import TokenLogprob
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.structured_spec import validate_structured
from engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from engine.validation import ValidatedPrompt, prompt_batch, validate_prompt


class LLM:
    """Owns one in-process EngineCore and its tokenizer: checks every prompt once (the offline
    API's entry point), runs them with continuous batching and detokenizes.

    Invariants: every request handed to the engine passed ``engine.validation`` here."""

    def __init__(self, config: ClusterConfig | str = "local", overrides: Sequence[str] = ()):
        self.config = load_config(config, overrides) if isinstance(config, str) else config
        self.engine = EngineCore(self.config, threads=self.config.workers.decode.num_threads)
        self.tokenizer = load_tokenizer(self.engine.model_directory, self.engine.info.arch.vocab_size)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling: SamplingParams | dict[str, object] | None = None,
    ) -> list[Completion]:
        """Run every prompt (text, or a list of token ids) to completion; results in input order.

        Every prompt and the sampling parameters are checked before any runs: a bad one raises
        ValueError naming the field and the value, e.g. ``prompt: must not be empty (got '')``."""
        sampling = SamplingParams.coerce(sampling)
        validate_structured(sampling.structured)
        prepared = [self._prompt(prompt) for prompt in prompt_batch(prompts)]
        if not prepared:
            return []
        detok: dict[str, IncrementalDetokenizer] = {}
        order: list[str] = []
        for prompt in prepared:
            request_id = f"llm-{next(self._ids)}"
            self.engine.add_request(request_id, list(prompt.token_ids), sampling)
            detok[request_id] = IncrementalDetokenizer(
                self.tokenizer, sampling.stop, sampling.include_stop_str_in_output
            )
            order.append(request_id)
        reasons: dict[str, str] = {}
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in order} if sampling.logprobs is not None else {}
        prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        while self.engine.has_work:
            for out in self.engine.step():
                d = detok[out.request_id]
                d.add(out.new_token_ids)
                if out.logprobs is not None:
                    logprobs[out.request_id].extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if d.stopped and not out.finished:
                    self.engine.scheduler.finish(out.request_id, RequestStatus.FINISHED_STOPPED)
                    self.engine.runner.forget(out.request_id)
                    reasons[out.request_id] = "stop"
                elif out.finished:
                    d.flush()
                    reasons[out.request_id] = out.finish_reason or "stop"
        return [
            Completion(
                self._text(prompt),
                detok[rid].text,
                list(detok[rid].token_ids),
                reasons.get(rid, "abort"),
                logprobs.get(rid),
                prompt_logprobs.get(rid),
            )
            for prompt, rid in zip(prepared, order, strict=True)
        ]

    def _text(self, prompt: ValidatedPrompt) -> str:
        """The prompt as text: the user's own, or its token ids decoded."""
        return prompt.text if prompt.text is not None else self.tokenizer.decode(list(prompt.token_ids))

    def _prompt(self, prompt: object) -> ValidatedPrompt:
        """The offline API's one check of a prompt (``engine.validation.validate_prompt``)
        against the engine's vocabulary and context; the engine itself only asserts."""
        info = self.engine.info
        return validate_prompt(prompt, info.arch.vocab_size, info.max_model_len, self.tokenizer.encode)
