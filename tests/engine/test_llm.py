"""The offline engine API on a tiny random model: generation, stop strings, sampling seeds."""

from __future__ import annotations

import math
import random

import pytest

from engine.llm import LLM
from engine.request import UncheckedRequestError
from engine.sampling_params import MIN_TEMPERATURE, SamplingParams
from engine.tokenizer import ByteTokenizer, IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    cache = tmp_path_factory.mktemp("cache")
    return LLM("tiny", [f"model.weights_cache_dir={cache}"])


def test_generate_returns_one_completion_per_prompt(llm: LLM) -> None:
    out = llm.generate(["hello", "a longer prompt for the tiny model"], SamplingParams(max_tokens=7, ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [7, 7]
    assert all(c.finish_reason == "length" for c in out)
    assert out[0].text == ByteTokenizer().decode(out[0].token_ids)
    assert llm.engine.coordinator.num_free_blocks == llm.engine.info.num_blocks - 1


def test_greedy_is_deterministic_and_independent_of_batch(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = llm.generate("same prompt", sp)[0]
    batched = llm.generate(["other", "same prompt", "x" * 40], sp)[1]
    assert alone.token_ids == batched.token_ids


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=123, ignore_eos=True)
    first = llm.generate("seeded", sp)[0]
    second = llm.generate(["noise", "seeded"], sp)[1]
    assert first.token_ids == second.token_ids


def test_stop_string_cuts_text_and_frees_blocks(llm: LLM) -> None:
    probe = llm.generate("stop here", SamplingParams(max_tokens=12, ignore_eos=True))[0]
    text = probe.text
    stop = next((text[i : i + 1] for i in range(2, len(text)) if text[i : i + 1].strip()), None)
    assert stop is not None, f"the seeded tiny model printed nothing to stop on: {text!r}"
    cut = llm.generate("stop here", SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    assert llm.engine.coordinator.num_free_blocks == llm.engine.info.num_blocks - 1


def test_incremental_detokenizer_holds_back_partial_utf8() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    euro = list("€".encode())
    assert detok.add(euro[:1]) == "" and detok.add(euro[1:2]) == ""
    assert detok.add(euro[2:]) == "€"


def _text(chunks: list[list[int]], stop: tuple[str, ...] = ()) -> tuple[str, str, bool]:
    """(the deltas joined, the final text, stopped) of one detokenizer fed ``chunks`` in order."""
    detok = IncrementalDetokenizer(ByteTokenizer(), stop)
    streamed = "".join(detok.add(chunk) for chunk in chunks) + detok.flush()
    return streamed, detok.text, detok.stopped


def _groupings(rng: random.Random, ids: list[int]) -> list[list[int]]:
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randrange(0, len(ids)))) if len(ids) > 1 else []
    return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]


# The 12 greedy tokens of the serve test's stream 63 (tiny-gemma3): two invalid lead bytes, "bbb",
# then seven stray continuation bytes. CI once streamed them as [..., [98, 132], ...] (a worker
# coalesces chunks that pile up under load) and the text lost its third "b".
CI_STREAM_63 = [174, 174, 98, 98, 98, 132, 132, 132, 132, 132, 132, 132]
ALPHABET = [98, 99, 32, 174, 132, 226, 130, 172, 240, 159, 152, 128, 0xC3, 0xA9, 255]  # ASCII, leads, continuations


def test_a_valid_character_is_never_held_back_behind_bytes_that_never_complete() -> None:
    one_by_one = _text([[t] for t in CI_STREAM_63])
    assert one_by_one == ("\ufffd\ufffdbbb", "\ufffd\ufffdbbb", False)
    assert _text([[174], [174], [98], [98], [98, 132]] + [[132]] * 6) == one_by_one
    assert _text([CI_STREAM_63]) == one_by_one


def test_detokenized_text_does_not_depend_on_how_tokens_are_grouped() -> None:
    """Whatever the grouping of the same token ids into ``add`` calls (a stream's chunks depend
    on load), the deltas and the text equal those of one token at a time."""
    rng = random.Random(15)
    for _ in range(300):
        ids = [rng.choice(ALPHABET) for _ in range(rng.randrange(1, 20))]
        chunks = _groupings(rng, ids)
        assert _text(chunks) == _text([[t] for t in ids]), (ids, chunks)


def test_where_a_stop_string_cuts_does_not_depend_on_how_tokens_are_grouped() -> None:
    """...and what was streamed is exactly the final text: the start of a stop string is held
    back until it is known not to be one, so a stream never sends text the final result cuts."""
    rng = random.Random(16)
    for stops in [("cb",), ("cb", "b c"), ("bbb", "c")]:
        for _ in range(300):
            ids = [rng.choice(ALPHABET) for _ in range(rng.randrange(1, 20))]
            chunks = _groupings(rng, ids)
            streamed, text, stopped = _text(chunks, stops)
            assert (streamed, text, stopped) == _text([[t] for t in ids], stops), (ids, chunks)
            assert streamed == text, (ids, chunks, stops)
            assert not any(stop in text for stop in stops)


def test_a_stop_string_split_across_tokens_never_leaks_into_the_stream() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), ("cb", "zz"))
    assert detok.add([ord("a")]) == "a"
    assert detok.add([ord("c")]) == ""  # might start "cb": held back
    assert detok.add([ord("b")]) == "" and detok.stopped and detok.text == "a"
    other = IncrementalDetokenizer(ByteTokenizer(), ("cb",))
    assert other.add([ord("c")]) == "" and other.add([ord("x")]) == "cx"  # not a stop after all
    assert other.add([ord("c")]) == "" and other.flush() == "c" and other.text == "cxc"
    earliest = IncrementalDetokenizer(ByteTokenizer(), ("yz", "xy"))
    assert earliest.add(list(b"axyz")) == "a" and earliest.text == "a"  # cut at the earliest stop


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2)])
def test_bad_sampling_params_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})


BAD_PROMPTS = [
    (None, r"^prompt: must be text or a list of token ids \(got None\)$"),
    (5, r"^prompt: must be text or a list of token ids \(got 5\)$"),
    ("", r"^prompt: must not be empty \(got ''\)$"),
    ([[]], r"^prompt: must not be empty \(got \[\]\)$"),
    ([[1, "a"]], r"^prompt: token id 'a' is not an integer \(position 1 of 2\)$"),
    ([1, 2.5], r"^prompt: token id 2.5 is not an integer \(position 1 of 2\)$"),
    ([3, -1], r"^prompt: token id -1 is outside the vocabulary \[0, 256\) \(position 1 of 2\)$"),
    ([3, 256], r"^prompt: token id 256 is outside the vocabulary \[0, 256\) \(position 1 of 2\)$"),
    (["fine", None], r"^prompt: must be text or a list of token ids \(got None\)$"),
]
BAD_SAMPLING = [
    ({"temperature": math.nan}, r"^temperature: must be a finite number \(got nan\)$"),
    ({"temperature": "abc"}, r"^temperature: must be a number \(got 'abc'\)$"),
    ({"top_p": -math.inf}, r"^top_p: must be a finite number \(got -inf\)$"),
    ({"max_tokens": "5"}, r"^max_tokens: must be an integer \(got '5'\)$"),
    ({"top_k": 2.0}, r"^top_k: must be an integer \(got 2.0\)$"),
    ("greedy", r"^sampling: must be SamplingParams or a dict of its fields \(got 'greedy'\)$"),
]


def _idle(llm: LLM) -> bool:
    return not llm.engine.has_work and llm.engine.coordinator.num_free_blocks == llm.engine.info.num_blocks - 1


@pytest.mark.parametrize("prompts,message", BAD_PROMPTS)
def test_llm_names_the_prompt_and_runs_nothing(llm: LLM, prompts, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert _idle(llm)  # a bad prompt in a batch: no other prompt was queued


@pytest.mark.parametrize("sampling,message", BAD_SAMPLING)
def test_llm_names_the_sampling_field_and_keeps_serving(llm: LLM, sampling, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(["a", "b"], sampling)
    assert _idle(llm)
    assert len(llm.generate("still fine", {"max_tokens": 3, "ignore_eos": True})[0].token_ids) == 3


def test_llm_refuses_a_prompt_without_room_to_generate(llm: LLM) -> None:
    limit = llm.engine.info.max_model_len
    with pytest.raises(ValueError, match=rf"^prompt: {limit} tokens leave no room to generate within max_model_len"):
        llm.generate([[7] * limit])
    assert _idle(llm)


def test_llm_takes_token_ids_as_a_prompt(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    as_text = llm.generate("hello", sp)[0]
    as_ids = llm.generate([list(b"hello")], sp)[0]
    assert as_ids.token_ids == as_text.token_ids and as_ids.prompt == "hello"


def test_the_engine_asserts_what_the_llm_checked(llm: LLM) -> None:
    """``LLM`` is the offline API's entry point: it names a bad field (above); ``EngineCore``
    behind it only asserts, and a request that skipped the checks is an internal error."""
    limit = llm.engine.info.max_model_len
    with pytest.raises(UncheckedRequestError, match="empty prompt"):
        llm.engine.add_request("empty", [], SamplingParams())
    with pytest.raises(UncheckedRequestError, match=rf"max_model_len={limit}"):
        llm.engine.add_request("long", [1] * limit, SamplingParams())
    with pytest.raises(AssertionError, match="sampling"):
        llm.engine.add_request("dict", [1, 2], {"max_tokens": 2})  # type: ignore[arg-type]
    assert _idle(llm)


def test_a_nan_temperature_never_reaches_the_sampler(llm: LLM) -> None:
    """The symptom this guards against: NaN passed validation and torch.multinomial failed
    inside step()."""
    with pytest.raises(ValueError, match=r"^temperature: must be a finite number \(got nan\)$"):
        llm.generate([[1, 2, 3]], {"temperature": math.nan, "max_tokens": 2})
    with pytest.raises(ValueError, match=r"^temperature: must be 0 \(greedy\) or >= 0.001 \(got 1e-40\)$"):
        llm.generate([[1, 2, 3]], {"temperature": 1e-40, "max_tokens": 2})
    assert _idle(llm)
    out = llm.generate("after", SamplingParams(max_tokens=3, temperature=MIN_TEMPERATURE, seed=1, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_the_engine_hashes_a_request_with_its_cache_salt(llm: LLM) -> None:
    """Requests share cached blocks only with requests of the same salt (none counts as one)."""
    engine = llm.engine
    prompt = [(7 * i) % 200 + 3 for i in range(3 * engine.info.block_size + 1)]

    def cached(request_id: str, salt: str | None) -> int:
        request = engine.add_request(request_id, prompt, SamplingParams(max_tokens=1), cache_salt=salt)
        while engine.has_work:
            engine.step()
        return request.num_cached_tokens

    assert cached("salt-a", "a") == 0
    assert cached("salt-a-again", "a") > 0
    assert cached("salt-b", "b") == 0
    assert cached("no-salt", None) == 0
    assert _idle(llm)
