"""A greedy single-engine oracle that also says how far each of its tokens was from a tie.

Greedy tokens are exact only up to the numerics: kvfleet's fp32 logits match Hugging Face's to
``LOGITS_ATOL`` (tests/model/test_logits_vs_hf.py; measured ~3e-6) and move by ~1e-6 with batch
composition and chunking. A test that compares a run with the oracle token for token is valid
when, at every generated position, the oracle's top-1 logit leads the runner-up by more than
``MIN_MARGIN``: two runs within ``LOGITS_ATOL`` of the same reference are within
``2 * LOGITS_ATOL`` of each other, which moves a gap by at most twice that. Tests assert the
margin instead of tolerating mismatches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from configs import ClusterConfig
from engine.sampling_params import SamplingParams

LOGITS_ATOL = 1e-4
MIN_MARGIN = 4 * LOGITS_ATOL


@dataclass(frozen=True)
class GreedyReference:
    """One prompt's greedy tokens from a single engine (alone, on an empty prefix cache) and, per
    generated position, the top-1 minus top-2 logit there."""

    token_ids: tuple[int, ...]
    margins: tuple[float, ...]

    @property
    def min_margin(self) -> float:
        return min(self.margins)


def greedy_references(
    config: ClusterConfig, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[GreedyReference]:
    """Each prompt run alone, greedy with ``ignore_eos``, on one engine built from ``config``."""
    return list(_references(config.model_dump_json(), tuple(tuple(p) for p in prompts), max_tokens))


@functools.cache
def _references(config_json: str, prompts: tuple[tuple[int, ...], ...], max_tokens: int) -> tuple[GreedyReference, ...]:
    from engine.core import EngineCore

    engine = EngineCore(ClusterConfig.model_validate_json(config_json), threads=1)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    try:
        for index, prompt in enumerate(prompts):
            assert engine.coordinator.reset_prefix_cache()
            request_id = f"oracle-{index}"
            engine.add_request(request_id, list(prompt), sampling)
            tokens: list[int] = []
            margins: list[float] = []
            while engine.has_work:
                output = engine.scheduler.schedule()
                sampled, rows = engine.runner.logits_for(output)
                if request_id in rows:
                    top = rows[request_id].topk(2).values
                    margins.append(float(top[0] - top[1]))
                for result in engine.scheduler.update(output, sampled):
                    tokens += result.new_token_ids
            assert len(tokens) == len(margins) == max_tokens, (len(tokens), len(margins))
            out.append(GreedyReference(tuple(tokens), tuple(margins)))
    finally:
        engine.close()
    return tuple(out)
