"""Offline API: ``LLM(config).generate(prompts, sampling)`` on one in-process EngineCore."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from configs import ClusterConfig, load_config
from engine.core import EngineCore
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, load_tokenizer


@dataclass(frozen=True)
class Completion:
    """One finished request: its text, the generated token ids and why it stopped."""

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str


class LLM:
    """Tokenize, run every prompt through one engine with continuous batching, detokenize."""

    def __init__(self, config: ClusterConfig | str = "local", overrides: Sequence[str] = ()):
        self.config = load_config(config, overrides) if isinstance(config, str) else config
        self.engine = EngineCore(self.config, threads=self.config.workers.decode.num_threads)
        self.tokenizer = load_tokenizer(self.engine.model_directory, self.engine.info.arch.vocab_size)
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str], sampling: SamplingParams | None = None) -> list[Completion]:
        sampling = sampling or SamplingParams()
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not texts:
            return []
        detok: dict[str, IncrementalDetokenizer] = {}
        order: list[str] = []
        for text in texts:
            request_id = f"llm-{next(self._ids)}"
            ids = self.tokenizer.encode(text)  # transformers tokenizers add BOS themselves
            if not ids:
                raise ValueError(f"prompt: encodes to no tokens (got {text!r})")
            self.engine.add_request(request_id, ids, sampling)
            detok[request_id] = IncrementalDetokenizer(self.tokenizer, sampling.stop, sampling.include_stop_str_in_output)
            order.append(request_id)
        reasons: dict[str, str] = {}
        while self.engine.has_work:
            for out in self.engine.step():
                d = detok[out.request_id]
                d.add(out.new_token_ids)
                if d.stopped and not out.finished:
                    self.engine.scheduler.finish(out.request_id, RequestStatus.FINISHED_STOPPED)
                    self.engine.runner.sampler.forget(out.request_id)
                    reasons[out.request_id] = "stop"
                elif out.finished:
                    reasons[out.request_id] = out.finish_reason or "stop"
        return [
            Completion(text, detok[rid].text, list(detok[rid].token_ids), reasons.get(rid, "abort"))
            for text, rid in zip(texts, order, strict=True)
        ]
