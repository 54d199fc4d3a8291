"""``scheduler.async_scheduling``: steps launched ahead of their tokens give the tokens of the
synchronous engine (prefill and mixed steps: tests/engine/test_async_mixed_steps.py).

Oracle: the same configuration with the flag off (every step read before the next is
scheduled). With the flag on, a decode-only step's continuation is scheduled and launched with
its input ids still on the device (``Scheduler.schedule_continuation``,
``ModelRunner.launch``), and the earlier step's tokens are read afterwards; on the CPU the
device is the host, so these tests check the bookkeeping: placeholders, discarded tokens of
requests that stopped, drains for arrivals and aborts, slots and blocks given back.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.support import load_preset

PRESETS = ["tiny", "tiny-hybrid", "tiny-qwen3-next"]


def engine(preset: str, overlap: bool, graphs: bool = True, *overrides: str) -> EngineCore:
    flags = [f"scheduler.async_scheduling={str(overlap).lower()}", f"model.cuda_graphs={str(graphs).lower()}"]
    return EngineCore(load_preset(preset, [*flags, *overrides]))


class LaunchSpy:
    """Counts launched steps, those whose input ids came from the step before on the device, and
    the sampled rows of each request (launched or run synchronously)."""

    def __init__(self, core: EngineCore):
        self.launches = self.continuations = 0
        self.rows: Counter[str] = Counter()
        inner = core.runner.launch
        execute = core.runner.execute

        def executed(output):
            self.rows.update(chunk.request.request_id for chunk in output.chunks if chunk.sample)
            return execute(output)

        def counted(output, previous=None):
            self.launches += 1
            self.continuations += previous is not None
            self.rows.update(chunk.request.request_id for chunk in output.chunks if chunk.sample)
            return inner(output, previous)

        core.runner.launch = counted  # type: ignore[method-assign]
        core.runner.execute = executed  # type: ignore[method-assign]


Plan = dict[int, list[tuple[str, list[int], SamplingParams]]]


def drive(
    core: EngineCore, arrivals: Plan, aborts: dict[int, list[str]] | None = None, errors: bool = False
) -> dict[str, tuple]:
    """Add ``arrivals[k]`` and abort ``aborts[k]`` before call ``k`` of ``step``; run to the end.
    Returns each request's tokens and finish reason (``errors``: requests may fail)."""
    aborts = aborts or {}
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    last = max([*arrivals, *aborts])
    for call in range(10_000):
        for request_id, prompt, sampling in arrivals.get(call, []):
            core.add_request(request_id, prompt, sampling)
            tokens[request_id] = []
        for request_id in aborts.get(call, []):
            assert core.abort(request_id)
            reasons[request_id] = "abort"
        if call > last and not core.has_work:
            break
        for out in core.step():
            assert errors or out.error is None, out.error
            assert reasons.get(out.request_id) is None, f"{out.request_id} gained tokens after it ended"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert not core.has_work and core.in_flight is None
    core.coordinator.check_invariants()
    if core.runner.decode is not None:
        assert core.runner.decode.num_slots_held == 0  # every finished request gave its slot back
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}


def prompts(seed: int, count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 50))] for _ in range(count)]


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, top_p=0.9, seed=seed, ignore_eos=True)


def compare(preset: str, graphs: bool, plan, aborts=None, *overrides: str) -> tuple[dict, LaunchSpy]:
    want = drive(engine(preset, False, graphs, *overrides), plan(), aborts)
    core = engine(preset, True, graphs, *overrides)
    spy = LaunchSpy(core)
    got = drive(core, plan(), aborts)
    assert got == want
    return got, spy


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_and_seeded_tokens_match_the_synchronous_engine(preset: str, graphs: bool) -> None:
    """Different max_tokens (requests leave the overlapped chain one by one), greedy and seeded
    rows in one batch, and a request arriving while the others decode (the chain pauses for its
    prefill and resumes)."""
    vocab = engine(preset, False, False).info.arch.vocab_size
    texts = prompts(5, 7, vocab)

    def plan() -> Plan:
        first = [(f"g{i}", texts[i], greedy(6 + 5 * i)) for i in range(4)]
        first += [(f"s{i}", texts[4 + i], seeded(9 + 7 * i, seed=100 + i)) for i in range(2)]
        return {0: first, 7: [("late", texts[6], greedy(12))]}

    got, spy = compare(preset, graphs, plan)
    assert all(len(tokens) > 0 for tokens, _ in got.values())
    if graphs:  # the static decode step exists: decode steps overlap
        assert spy.continuations > 10
    else:  # no static decode step: every step runs synchronously
        assert spy.launches == 0


@pytest.mark.parametrize("preset", PRESETS)
def test_stop_tokens_and_eos_mid_run(preset: str) -> None:
    """Requests that stop on a stop token or EOS while their next step is already launched: the
    discarded step changes nothing, their blocks and slots come back."""
    probe = engine(preset, False)
    texts = prompts(9, 12, probe.info.arch.vocab_size)
    outputs = drive(probe, {0: [(f"r{i}", text, greedy(30)) for i, text in enumerate(texts)]})
    # prompts whose output gains a new token mid-run (the tiny models repeat themselves a lot)
    mid_run = [(i, *new) for i in range(len(texts)) if (new := first_new_token(outputs[f"r{i}"][0], 4))]
    assert len(mid_run) >= 2, outputs
    (stopping, stop_at, stop_token), (ending, eos_at, eos) = mid_run[:2]
    others = [i for i in range(len(texts)) if i not in (stopping, ending)]

    def plan() -> Plan:
        return {
            0: [
                ("stop", texts[stopping], greedy(30, stop_token_ids=(stop_token,))),
                ("eos", texts[ending], SamplingParams(max_tokens=30, temperature=0.0)),
                ("greedy", texts[others[0]], greedy(30)),
                ("seeded", texts[others[1]], seeded(25, seed=7)),
            ]
        }

    want = drive(_with_eos(engine(preset, False), eos), plan())
    core = _with_eos(engine(preset, True), eos)
    spy = LaunchSpy(core)
    got = drive(core, plan())
    assert got == want
    assert got["stop"] == (outputs[f"r{stopping}"][0][: stop_at + 1], "stop")
    assert got["eos"] == (outputs[f"r{ending}"][0][: eos_at + 1], "stop")
    # a sampled row per token, and one more launched before its stop was read
    assert spy.rows["stop"] == stop_at + 2 and spy.rows["eos"] == eos_at + 2
    # the others went on overlapping: a stop drops its row from the continuation
    assert spy.continuations >= max(stop_at, eos_at) - 1
    assert spy.continuations > 10


def first_new_token(tokens: list[int], start: int) -> tuple[int, int] | None:
    """(index, id) of the first token at or after ``start`` that did not occur before it."""
    for index in range(start, len(tokens)):
        if tokens[index] not in tokens[:index]:
            return index, tokens[index]
    return None


def _with_eos(core: EngineCore, eos: int) -> EngineCore:
    core.eos_token_id = eos  # requests added from now on stop on it (unless they ignore it)
    return core


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_abort_mid_decode(preset: str) -> None:
    """An abort while a step of the request is in flight: that step's token is dropped (the
    caller never saw it), the others' tokens are returned by the next step."""
    vocab = engine(preset, False, False).info.arch.vocab_size
    texts = prompts(13, 3, vocab)

    def plan() -> Plan:
        return {0: [(f"r{i}", text, greedy(20)) for i, text in enumerate(texts)]}

    got, spy = compare(preset, True, plan, {6: ["r1"]})
    assert got["r1"][1] == "abort" and 0 < len(got["r1"][0]) < 20
    assert spy.continuations > 5


def test_memory_pressure_ends_the_chain_before_preempting() -> None:
    """A pool too small for the batch: a continuation that cannot get a block gives way to the
    synchronous step, which preempts as the synchronous engine does."""
    small = ("kv_cache.num_blocks=96", "kv_cache.pinning.enabled=false")
    vocab = engine("tiny", False, False).info.arch.vocab_size
    texts = prompts(17, 14, vocab)

    def plan() -> Plan:
        return {0: [(f"r{i}", text, greedy(40)) for i, text in enumerate(texts)]}

    want_core = engine("tiny", False, True, *small)
    want = drive(want_core, plan())
    core = engine("tiny", True, True, *small)
    got = drive(core, plan())
    assert want_core.scheduler.num_preemptions > 0
    assert core.scheduler.num_preemptions == want_core.scheduler.num_preemptions
    assert got == want


def test_stop_strings_on_the_host() -> None:
    """``LLM`` ends a request on a stop string after the step that returned it, while its next
    step is in flight: the completion is the synchronous one."""
    config = ["model.cuda_graphs=true"]
    sync = LLM("tiny", config)
    probe = sync.generate("stop here", greedy(12))[0]
    stop = probe.text[len(probe.text) // 2 :][:2]
    sampling = greedy(12, stop=(stop,))
    want = sync.generate(["stop here", "keep going a while"], sampling)
    overlapped = LLM("tiny", [*config, "scheduler.async_scheduling=true"])
    got = overlapped.generate(["stop here", "keep going a while"], sampling)
    assert [(c.text, c.token_ids, c.finish_reason) for c in got] == [
        (c.text, c.token_ids, c.finish_reason) for c in want
    ]
    assert want[0].finish_reason == "stop"
    assert overlapped.engine.in_flight is None and not overlapped.engine.has_work


class Faults:
    """Makes the ``at``-th sampled step's logits non-finite in row 0, or its decode forward raise."""

    def __init__(self, core: EngineCore, at: int, kind: str):
        self.calls = 0
        runner = core.runner
        if kind == "nan":
            logits = runner.model.logits

            def poisoned_logits(hidden):
                out = logits(hidden)
                self.calls += 1
                if self.calls == at:
                    out[0, 3] = float("nan")
                return out

            runner.model.logits = poisoned_logits
        else:
            assert runner.decode is not None
            # the decode step itself: a captured one replays its graph and never calls forward
            run = runner.decode.run

            def failing_run(*args, **kwargs):
                self.calls += 1
                if self.calls == at:
                    raise RuntimeError("injected fault in the decode forward")
                return run(*args, **kwargs)

            runner.decode.run = failing_run


@pytest.mark.parametrize("kind", ["nan", "raise"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_failures_mid_decode_match_the_synchronous_engine(preset: str, kind: str) -> None:
    """A row with non-finite logits in a launched step fails its request alone (its next step,
    launched already, is dropped); a decode forward that raises fails the requests of its batch
    after the step before it was read. Everything else is the synchronous engine's."""
    vocab = engine(preset, False, False).info.arch.vocab_size
    texts = prompts(21, 4, vocab)

    def plan() -> Plan:
        return {0: [(f"r{i}", text, greedy(16)) for i, text in enumerate(texts)]}

    results = []
    for overlap in (False, True):
        core = engine(preset, overlap)
        Faults(core, 6, kind)
        results.append((drive(core, plan(), errors=True), core.counters.failed_requests, core.counters.failed_steps))
    assert results[0] == results[1]
    (got, failed_requests, failed_steps) = results[1]
    assert failed_requests == (1 if kind == "nan" else 4) and failed_steps == (kind == "raise")
    assert sum(reason == "error" for _, reason in got.values()) == failed_requests


def test_a_row_that_cannot_be_sampled_in_a_launched_step_fails_alone() -> None:
    """A NaN temperature (past validation) met in a decode step: ``sample_on_device`` fails that
    request only, as ``sample`` does."""
    vocab = engine("tiny", False, False).info.arch.vocab_size
    texts = prompts(23, 3, vocab)
    bad = SamplingParams.model_construct(**{**seeded(8, 5).model_dump(), "temperature": float("nan")})
    results = []
    for overlap in (False, True):
        core = engine("tiny", overlap)
        spy = LaunchSpy(core)
        for request_id, text, sampling in [("a", texts[0], greedy(10)), ("b", texts[1], seeded(10, 3))]:
            core.add_request(request_id, text, sampling)
        core.add_request("bad", texts[2], seeded(10, 5))
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str | None] = {}
        for call in range(100):
            if call == 3:  # decoding by now: its next sampling raises
                core.scheduler.requests["bad"].sampling = bad
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                reasons[out.request_id] = out.finish_reason
            if not core.has_work:
                break
        assert core.counters.failed_requests == 1 and (spy.launches > 3) == overlap
        results.append((tokens, reasons))
    # the overlapped engine sampled "bad"'s step read at call 3 when it was launched, before the
    # change: one token more; everything else is the same
    (want, want_reasons), (got, got_reasons) = results
    assert got_reasons == want_reasons and got_reasons["bad"] == "error"
    assert {k: want[k] for k in "ab"} == {k: got[k] for k in "ab"}
    assert got["bad"][: len(want["bad"])] == want["bad"] and len(got["bad"]) <= len(want["bad"]) + 1
