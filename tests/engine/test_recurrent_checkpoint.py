"""A hybrid prefix that diverges inside a prefill chunk (``engine.scheduler.recurrent_checkpoint``),
through the real EngineCore on the tiny Bamba preset (block 4, chunk 64).

Request 1 = P + U1 caches recurrent states at its chunk ends (64, 128, ...). Request 2 =
P[:CUT] + U2 (CUT = 100: inside the chunk [64, 128), on a block boundary) hits attention up to
100 but the recurrent group only at 64. The scheduler ends request 2's chunk at 100, so the
state there is cached and request 3 = P[:CUT] + U3 hits all 100 tokens; without the rule it
would hit 64 again (request 2's chunks end at 128 instead).

Oracle: the greedy tokens of a cold engine (prefix caching off), exactly.
"""

from __future__ import annotations

import random

import pytest

import engine.scheduler as scheduler_module
from configs import load_config
from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from tests.engine.test_pd import run_to_end

PRESET = "tiny-hybrid"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CHUNK = 64
CUT = 100  # a block boundary (block 4) inside the chunk [64, 128)


def workload() -> list[list[int]]:
    rng = random.Random(13)
    prefix = [rng.randrange(3, 250) for _ in range(150)]
    unique = [[rng.randrange(3, 250) for _ in range(n)] for n in (30, 9, 13)]
    unique[1][0], unique[2][0] = 1, 2  # requests 2 and 3 diverge right at CUT
    return [prefix + unique[0], prefix[:CUT] + unique[1], prefix[:CUT] + unique[2]]


def run_one_by_one(engine: EngineCore, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each request to its end before the next arrives; (tokens, cached tokens) per request."""
    tokens, cached = [], []
    for i, prompt in enumerate(prompts):
        request = engine.add_request(f"r{i}-{id(prompts)}", prompt, GREEDY)
        tokens.append(run_to_end(engine, {request.request_id})[request.request_id][0])
        cached.append(request.num_cached_tokens)
    engine.coordinator.check_invariants()
    return tokens, cached


@pytest.fixture(scope="module")
def cold_tokens() -> list[list[int]]:
    engine = EngineCore(load_config(PRESET, ["kv_cache.prefix_caching=false"]))
    tokens, cached = run_one_by_one(engine, workload())
    assert cached == [0, 0, 0]
    return tokens


@pytest.mark.parametrize("rule", [True, False], ids=["rule", "no-rule"])
def test_a_prefix_diverging_inside_a_chunk_is_hit_whole_by_its_next_request(
    rule: bool, cold_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = EngineCore(load_config(PRESET))
    assert engine.config.scheduler.prefill_chunk_size == CHUNK and CUT % engine.coordinator.alignment == 0
    if not rule:  # the control: what the scheduler did before (and the mutation this test catches)
        monkeypatch.setattr(scheduler_module, "recurrent_checkpoint", lambda *_: 0)
    tokens, cached = run_one_by_one(engine, workload())
    assert tokens == cold_tokens
    # request 2: attention could serve CUT, the recurrent state exists only at the chunk end 64
    assert cached[:2] == [0, CHUNK]
    assert cached[2] == (CUT if rule else CHUNK)


def test_requests_hitting_the_new_state_in_one_batch_stay_exact(cold_tokens: list[list[int]]) -> None:
    """Requests 2 and 3 admitted together: 3 must not use the state 2 writes in the same step."""
    engine = EngineCore(load_config(PRESET))
    first, second, third = workload()
    tokens, _ = run_one_by_one(engine, [first])
    ids = [engine.add_request(f"b{i}", p, GREEDY).request_id for i, p in enumerate((second, third))]
    done = run_to_end(engine, set(ids))
    assert [tokens[0], done[ids[0]][0], done[ids[1]][0]] == cold_tokens
    engine.coordinator.check_invariants()
