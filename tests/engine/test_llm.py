"""The offline engine API on a tiny random model: generation, stop strings, sampling seeds."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
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


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2)])
def test_bad_sampling_params_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})
