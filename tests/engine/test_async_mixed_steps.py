"""``scheduler.async_scheduling`` over prefill and mixed steps: a step holding prompt chunks is
launched like a decode step, and the step after it is scheduled and launched while it runs.

Oracle: the same configuration with the flag off (every step read before the next is scheduled).
The workload is the short issue-4 mix (``tests.model.test_mixed_step.short_mix``) with its
requests arriving a few steps apart and a token budget that splits prompts into chunks, so
prompt chunks run beside decodes, requests start decoding in the step after their last prompt
chunk (their first input token a placeholder read on the device) and leave by length while
others are admitted. On the CPU the device is the host, so these tests check the control flow:
which steps overlap (``EngineCounters.overlapped_steps``), the placeholders, the tokens.
"""

from __future__ import annotations

from collections import Counter

import pytest

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from tests.engine.test_async_scheduling import Plan, drive, greedy, seeded
from tests.engine.test_async_scheduling import engine as async_engine
from tests.model.test_mixed_step import short_mix

PRESETS = ["tiny", "tiny-hybrid", "tiny-granite-h", "tiny-nemotron-h", "tiny-qwen3-next"]
#: prompts of up to 120 tokens run in several chunks beside the decodes
BUDGET = ("scheduler.max_num_batched_tokens=64", "scheduler.prefill_chunk_size=32")


def engine(preset: str, overlap: bool, *overrides: str) -> EngineCore:
    return async_engine(preset, overlap, True, *BUDGET, *overrides)


class StepSpy:
    """Records each launched step: whether the step before it was in flight, whether it holds a
    prompt chunk, and its placeholder chunks that are a request's first decode (the request's
    last prompt chunk was in the step before)."""

    def __init__(self, core: EngineCore):
        self.overlapped_prompt = self.first_decodes = self.known_beside_placeholders = 0
        self.rows: Counter[str] = Counter()
        runner = core.runner
        inner = runner.launch

        def launch(output, previous=None):
            prompt = any(c.num_tokens > 1 for c in output.chunks)
            placeholders = [c for c in output.chunks if c.start >= len(c.request.token_ids)]
            if previous is not None:
                self.overlapped_prompt += prompt
                self.first_decodes += sum(c.start == c.request.prompt_len for c in placeholders)
                self.known_beside_placeholders += bool(placeholders) and len(placeholders) < len(output.chunks)
            else:
                assert not placeholders, "a placeholder without a launched step before"
            self.rows.update(c.request.request_id for c in output.chunks if c.sample)
            return inner(output, previous)

        runner.launch = launch  # type: ignore[method-assign]


def staggered(vocab: int, count: int = 8, every: int = 3, sampling=None) -> Plan:
    """The short mix, two requests at call 0, then one every ``every`` calls."""
    plan: Plan = {}
    for i, (prompt, max_tokens) in enumerate(short_mix(vocab, count)):
        at = 0 if i < 2 else (i - 1) * every
        params = sampling(i, max_tokens) if sampling else greedy(max_tokens)
        plan.setdefault(at, []).append((f"r{i}", prompt, params))
    return plan


def compare(preset: str, plan_of, aborts=None, *overrides: str) -> tuple[dict, EngineCore, StepSpy]:
    sync = engine(preset, False, *overrides)
    vocab = sync.info.arch.vocab_size
    want = drive(sync, plan_of(vocab), aborts)
    core = engine(preset, True, *overrides)
    spy = StepSpy(core)
    got = drive(core, plan_of(vocab), aborts)
    assert got == want
    assert core.runner.eager_steps == 0 and sync.runner.eager_steps == 0
    return got, core, spy


@pytest.mark.parametrize("preset", PRESETS)
def test_mixed_steps_overlap_and_give_the_synchronous_tokens(preset: str) -> None:
    """Greedy and seeded requests of the staggered mix: steps with prompt chunks are launched
    while the step before runs, among them steps where a request decodes its first token right
    after its last prompt chunk; the tokens are the synchronous engine's."""

    def sampling(i: int, max_tokens: int) -> SamplingParams:
        return seeded(max_tokens, seed=40 + i) if i % 3 == 2 else greedy(max_tokens)

    got, core, spy = compare(preset, lambda vocab: staggered(vocab, sampling=sampling))
    assert all(tokens and reason == "length" for tokens, reason in got.values())
    counters = core.counters
    assert counters.overlapped_prompt_steps == spy.overlapped_prompt > 3
    assert counters.overlapped_steps > counters.overlapped_prompt_steps
    assert spy.first_decodes > 0
    assert counters.step_prompt_tokens == 0 and core.in_flight is None


def test_most_steps_of_the_mix_overlap() -> None:
    """Only the first step of a chain is launched without a step in flight; a chain ends where
    no step is left to run, or a block must be found by preemption."""
    sync = engine("tiny", False)
    calls = 0
    plan = staggered(sync.info.arch.vocab_size)
    core = engine("tiny", True)
    for call in range(10_000):
        for request_id, prompt, sampling in plan.get(call, []):
            core.add_request(request_id, prompt, sampling)
        if call > max(plan) and not core.has_work:
            break
        core.step()
        calls += 1
    counters = core.counters
    assert counters.overlapped_steps >= calls - 3, (counters.overlapped_steps, calls)
    assert counters.overlapped_prompt_steps > 3


def test_budget_starved_decodes_read_known_ids_beside_placeholders() -> None:
    """More decoding requests than the token budget: the requests a step leaves out decode
    later from their known token, in steps whose other rows are placeholders."""
    overrides = ("scheduler.max_num_batched_tokens=16", "scheduler.prefill_chunk_size=16")

    def plan(vocab: int) -> Plan:
        return {0: [(f"r{i}", prompt[:12], greedy(6 + i % 5)) for i, (prompt, _) in enumerate(short_mix(vocab, 14))]}

    _, core, spy = compare("tiny", plan, None, *overrides)
    assert spy.known_beside_placeholders > 0
    assert core.counters.overlapped_steps > 10


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_stops_and_aborts_while_a_mixed_step_runs(preset: str) -> None:
    """A request that stops on a stop token and one aborted while steps with prompt chunks are
    in flight: both end as in the synchronous engine, the others' tokens are unchanged. The
    aborted request arrived mid-chain, so its outputs lag the synchronous engine's by a step
    (its first step was scheduled a call later, as every arrival's is while a step is in
    flight): it has the synchronous tokens but the last one, at most."""
    probe = engine(preset, False)
    vocab = probe.info.arch.vocab_size
    outputs = drive(probe, staggered(vocab))
    stop_token = outputs["r1"][0][2]  # r1 stops on its third token (or earlier, on a repeat)

    def plan(v: int) -> Plan:
        return staggered(v, sampling=lambda i, n: greedy(n, stop_token_ids=(stop_token,)) if i == 1 else greedy(n))

    aborts = {10: ["r3"]}  # r3 arrives at call 6
    want = drive(engine(preset, False), plan(vocab), aborts)
    core = engine(preset, True)
    spy = StepSpy(core)
    got = drive(core, plan(vocab), aborts)
    aborted = got.pop("r3")
    wanted = want.pop("r3")
    assert got == want
    assert aborted[1] == wanted[1] == "abort"
    assert len(wanted[0]) - 1 <= len(aborted[0]) <= len(wanted[0]) and aborted[0] == wanted[0][: len(aborted[0])]
    assert aborted[0], "r3 decoded before its abort"
    assert got["r1"][1] == "stop" and got["r1"][0][-1] == stop_token
    assert spy.overlapped_prompt > 0 and core.runner.eager_steps == 0


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_preemption_under_memory_pressure(preset: str) -> None:
    """A pool too small for the mix: a step whose blocks cannot be had ends the chain and the
    synchronous step preempts, as the synchronous engine does."""
    small = ("kv_cache.num_blocks=64", "kv_cache.pinning.enabled=false")

    def plan(vocab: int) -> Plan:
        return staggered(vocab, count=10, every=1)

    sync = engine(preset, False, *small)
    want = drive(sync, plan(sync.info.arch.vocab_size))
    core = engine(preset, True, *small)
    got = drive(core, plan(core.info.arch.vocab_size))
    assert sync.scheduler.num_preemptions > 0
    assert got == want
    assert core.counters.overlapped_prompt_steps > 0


def test_a_request_needing_the_host_ends_the_chain() -> None:
    """A logprobs request arriving mid-run: no step holding it is launched (its rows need the
    host), the steps before and after it overlap, every token and logprob is the synchronous
    engine's."""

    def run(overlap: bool) -> tuple[dict, dict, EngineCore, StepSpy]:
        core = engine("tiny", overlap)
        spy = StepSpy(core)
        plan = staggered(core.info.arch.vocab_size, count=4)
        logprobs: dict[str, list] = {}
        tokens: dict[str, list[int]] = {}
        for call in range(1000):
            for request_id, prompt, sampling in plan.get(call, []):
                core.add_request(request_id, prompt, sampling)
            if call == 4:
                core.add_request("lp", plan[0][0][1][:20], greedy(5, logprobs=2))
            if call > max(plan) and not core.has_work:
                break
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.logprobs:
                    logprobs.setdefault(out.request_id, []).extend(out.logprobs)
        return tokens, logprobs, core, spy

    want_tokens, want_logprobs, _, _ = run(False)
    got_tokens, got_logprobs, core, spy = run(True)
    assert got_tokens == want_tokens and len(want_logprobs["lp"]) == 5
    # "lp" starts a step later beside other requests, so its logprobs match to float rounding
    for got, want in zip(got_logprobs["lp"], want_logprobs["lp"], strict=True):
        assert (got.token_id, got.rank, [t for t, _ in got.top]) == (want.token_id, want.rank, [t for t, _ in want.top])
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert spy.rows["lp"] == 0 and spy.rows["r0"] > 0
    assert core.counters.overlapped_steps > 0 and core.counters.overlapped_prompt_steps > 0
