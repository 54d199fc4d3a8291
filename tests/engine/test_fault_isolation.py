"""Fault isolation inside one engine: a request that cannot be sampled fails alone, a forward that
raises fails only its batch, nothing the failed step registered stays in the prefix cache, and the
engine serves on with exactly the tokens it gives when nothing failed. An engine whose every step
fails says so (``EngineBroken``) instead of failing requests forever.

Oracle: the greedy tokens of a fresh engine of the same config that never saw a failure.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from configs import load_config
from engine.core import MAX_CONSECUTIVE_FAILED_STEPS, EngineBroken, EngineCore
from engine.sampling_params import SamplingParams
from tests.engine.test_pd import run_to_end

PRESETS = ["tiny", "tiny-hybrid"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
POISON = 255  # a token id the forward refuses once armed (no other prompt here contains it)


class PoisonedModel:
    """Wraps a model: its forward raises whenever the batch holds the poison token (while armed)."""

    def __init__(self, model: Any):
        self.model = model
        self.armed = True
        self.raised = 0

    def __call__(self, batch: Any) -> Any:
        if self.armed and POISON in batch.input_ids.tolist():
            self.raised += 1
            raise RuntimeError("injected fault in the forward")
        return self.model(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=PRESETS)
def preset(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def oracle(preset: str) -> EngineCore:
    return EngineCore(load_config(preset))


def oracle_tokens(engine: EngineCore, batch: list[list[int]]) -> list[list[int]]:
    ids = [f"oracle-{i}-{random.random()}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch, strict=True):
        engine.add_request(rid, prompt, GREEDY)
    done = run_to_end(engine, set(ids))
    return [done[rid][0] for rid in ids]


def free_blocks_are_back(engine: EngineCore) -> bool:
    engine.coordinator.check_invariants()
    return engine.coordinator.num_free_blocks == engine.info.num_blocks - 1


def test_a_request_that_cannot_be_sampled_fails_alone(preset: str, oracle: EngineCore) -> None:
    engine = EngineCore(load_config(preset))
    good = prompts(1, [9, 17, 30])
    expected = oracle_tokens(oracle, good)
    # a NaN temperature that got past validation (model_construct skips it): the sampler refuses
    bad = SamplingParams.model_construct(**{**GREEDY.model_dump(), "temperature": float("nan")})
    for i, prompt in enumerate(good):
        engine.add_request(f"good-{i}", prompt, GREEDY)
    engine.add_request("bad", prompts(2, [12])[0], bad)
    done = run_to_end(engine, {"bad", "good-0", "good-1", "good-2"})
    assert done["bad"] == ([], "error")
    assert [done[f"good-{i}"][0] for i in range(3)] == expected
    assert engine.counters.failed_requests == 1 and engine.counters.failed_steps == 0
    assert free_blocks_are_back(engine)


def test_non_finite_logits_fail_the_request_instead_of_a_silent_token(preset: str) -> None:
    engine = EngineCore(load_config(preset))
    model = engine.runner.model

    class NaNLogits(PoisonedModel):
        def logits(self, hidden: Any) -> Any:
            out = self.model.logits(hidden)
            out[0, 5] = float("nan")
            return out

    engine.runner.model = NaNLogits(model)
    engine.add_request("nan", prompts(3, [10])[0], GREEDY)
    results = []
    while engine.has_work:
        results += [r for r in engine.step() if r.request_id == "nan"]
    assert [(r.new_token_ids, r.finished, r.finish_reason) for r in results] == [([], True, "error")]
    assert "non-finite logits" in (results[0].error or "")
    assert free_blocks_are_back(engine)


def test_a_failed_forward_fails_its_batch_and_leaves_no_unwritten_block_cached(preset: str, oracle: EngineCore) -> None:
    engine = EngineCore(load_config(preset))
    poisoned = PoisonedModel(engine.runner.model)
    engine.runner.model = poisoned
    shared = [POISON] + prompts(4, [23])[0]  # six full blocks of 4 tokens, all in the failing chunk
    later = [[*shared, 7, 8, 9], prompts(5, [14])[0]]
    expected = oracle_tokens(oracle, later)

    engine.add_request("poisoned", [*shared, 11], GREEDY)
    engine.add_request("batch-mate", prompts(6, [13])[0], GREEDY)
    done = run_to_end(engine, {"poisoned", "batch-mate"})
    assert poisoned.raised == 1
    assert done == {"poisoned": ([], "error"), "batch-mate": ([], "error")}
    assert free_blocks_are_back(engine)
    # The failed step registered the shared prefix's blocks before computing them; had they stayed
    # cached, this request would hit never-written KV and decode wrong tokens without an error.
    hit = engine.coordinator.find_longest_cache_hit(_hashes(engine, shared), 24)
    assert hit.num_tokens == 0
    poisoned.armed = False
    for i, prompt in enumerate(later):
        engine.add_request(f"after-{i}", prompt, GREEDY)
    done = run_to_end(engine, {"after-0", "after-1"})
    assert [done[f"after-{i}"] for i in range(2)] == [(tokens, "length") for tokens in expected]
    assert engine.consecutive_failed_steps == 0
    assert free_blocks_are_back(engine)


def test_an_engine_whose_every_step_fails_reports_itself_broken(preset: str) -> None:
    engine = EngineCore(load_config(preset))
    engine.runner.model = PoisonedModel(engine.runner.model)
    with pytest.raises(EngineBroken, match=f"{MAX_CONSECUTIVE_FAILED_STEPS} steps in a row failed"):
        for i in range(MAX_CONSECUTIVE_FAILED_STEPS):
            engine.add_request(f"r{i}", [POISON, 3, 4], GREEDY)
            assert [(r.request_id, r.finish_reason) for r in engine.step()] == [(f"r{i}", "error")]


def _hashes(engine: EngineCore, tokens: list[int]) -> list[bytes]:
    from engine.kv_cache.hashing import block_hashes

    return block_hashes(tokens, engine.coordinator.hash_block_size)
