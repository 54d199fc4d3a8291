"""A request resumed from its prompt and the tokens it generated elsewhere (``EngineCore.add_request
(output_token_ids=...)``) continues exactly as the uninterrupted run; async scheduling falls back
to synchronous steps for rows whose sampling needs the host (penalties, logprobs), with the same
tokens and logprobs.

Oracles: the uninterrupted run on a fresh engine (greedy, and seeded sampling whose draw for the
k-th output token depends only on (seed, k)); the synchronous engine for async scheduling.
"""

from __future__ import annotations

import random

import pytest

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from tests.engine.test_async_scheduling import LaunchSpy
from tests.support import load_preset

MAX_TOKENS = 14
SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=7),
    "penalised": SamplingParams(
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        temperature=0.8,
        seed=7,
        frequency_penalty=0.9,
        presence_penalty=0.4,
        repetition_penalty=1.3,
    ),
}


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def generate(core: EngineCore, request_id: str, tokens: list[int], sampling: SamplingParams, done=()) -> list[int]:
    core.add_request(request_id, tokens, sampling, output_token_ids=list(done))
    out: list[int] = []
    while core.has_work:
        for result in core.step():
            assert result.error is None, result.error
            out.extend(result.new_token_ids)
            if result.finished:
                assert result.finish_reason == "length"
    return out


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_a_resumed_request_continues_as_the_uninterrupted_run(preset: str, kind: str) -> None:
    sampling = SAMPLINGS[kind]
    first = EngineCore(load_preset(preset))
    text = prompt(3, 21, first.info.arch.vocab_size)
    whole = generate(first, "whole", text, sampling)
    assert len(whole) == MAX_TOKENS
    if kind != "greedy":  # sampled, not the argmax every time
        assert whole != generate(EngineCore(load_preset(preset)), "g", text, SAMPLINGS["greedy"])
    for k in (1, 6, MAX_TOKENS - 1):
        # another worker (nothing cached), and the first one again (prompt + outputs cached)
        elsewhere = generate(EngineCore(load_preset(preset)), f"moved-{k}", text, sampling, whole[:k])
        assert elsewhere == whole[k:], (k, elsewhere, whole)
        assert generate(first, f"again-{k}", text, sampling, whole[:k]) == whole[k:]
    hit = first.scheduler.hit_tokens
    assert hit > 0  # the resumed runs on the first worker reused its cached prefix


def test_resumed_outputs_count_toward_max_tokens() -> None:
    core = EngineCore(load_preset("tiny"))
    text = prompt(4, 9, core.info.arch.vocab_size)
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    whole = generate(core, "whole", text, sampling)
    assert generate(core, "resumed", text, sampling, whole[:3]) == whole[3:]
    request = core.add_request("full", text, sampling, output_token_ids=whole[:4])
    assert request.prompt_len == len(text) and request.num_output_tokens == 4


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    for rid, (tokens, sampling) in requests.items():
        core.add_request(rid, tokens, sampling)
    got: dict[str, tuple[list[int], list]] = {rid: ([], []) for rid in requests}
    while core.has_work:
        for out in core.step():
            assert out.error is None, out.error
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.logprobs or [])
    assert core.in_flight is None
    return got


def engine(preset: str, overlap: bool) -> EngineCore:
    return EngineCore(
        load_preset(preset, [f"scheduler.async_scheduling={str(overlap).lower()}", "model.cuda_graphs=true"])
    )


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_async_scheduling_samples_host_dependent_rows_synchronously(preset: str) -> None:
    vocab = engine(preset, False).info.arch.vocab_size
    texts = [prompt(10 + i, 6 + 5 * i, vocab) for i in range(4)]
    mixed = {
        "plain": (texts[0], SAMPLINGS["greedy"]),
        "seeded": (texts[1], SAMPLINGS["seeded"]),
        "penalised": (texts[2], SAMPLINGS["penalised"]),
        "logprobs": (texts[3], SAMPLINGS["greedy"].replace(logprobs=2)),
    }
    plain = {rid: mixed[rid] for rid in ("plain", "seeded")}
    for requests, overlaps in ((mixed, False), (plain, True)):
        want = run(engine(preset, False), requests)
        core = engine(preset, True)
        spy = LaunchSpy(core)
        assert run(core, requests) == want
        # rows needing the host keep the whole batch synchronous; plain rows overlap
        assert (spy.continuations > 5) == overlaps, spy.continuations
    assert len(want["plain"][0]) == MAX_TOKENS
