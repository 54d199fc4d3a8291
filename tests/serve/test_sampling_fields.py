"""The sampling and scoring fields through the real ``openai`` client against the real server
(tiny Gemma3, fp32): logprobs and top logprobs (chat and completions, ``echo`` included) equal
Hugging Face's log-softmax of the same checkpoint within 1e-4; ``n`` and ``best_of`` fan out with
per-sample seeds; penalties, ``logit_bias`` and ``min_p`` give the greedy tokens a direct
computation on HF's logits predicts; structured output constrains the text."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import resolve_model_directory
from engine.tokenizer import ByteTokenizer
from tests.oracle import MIN_MARGIN
from tests.serve.conftest import Server
from tests.serve.test_openai_api import prompt_text

ATOL = 1e-4  # fp32 logprobs vs HF (tests/model/logits_harness.py)
TOP = 5
TOKENIZER = ByteTokenizer()
NO_EOS = {"ignore_eos": True}

Adjust = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


@functools.cache
def _hf(directory: str) -> torch.nn.Module:
    """HF transformers' fp32 model of the checkpoint the server's workers load."""
    from tests.model.logits_harness import hf_model

    return hf_model(Path(directory))


def hf_log_softmax(server: Server, ids: list[int]) -> torch.Tensor:
    """HF's fp32 log-softmax over the vocabulary at every position of ``ids``."""
    model = _hf(str(resolve_model_directory(server.config)))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def hf_greedy(server: Server, prompt: list[int], max_tokens: int, adjust: Adjust) -> list[int]:
    """Greedy tokens from HF's logits after ``adjust(logits, prompt, output_so_far)``; asserts each
    step's winner leads the runner-up by more than ``MIN_MARGIN`` (so the server's tokens, within
    1e-4 of HF's logits, cannot differ)."""
    model = _hf(str(resolve_model_directory(server.config)))
    out: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        adjusted = adjust(logits.clone(), prompt, out)
        top2 = torch.topk(adjusted, 2)
        assert float(top2.values[0] - top2.values[1]) > MIN_MARGIN, (prompt, out, top2)
        out.append(int(top2.indices[0]))
    return out


def token_id(token: str) -> int:
    """A byte-level token string back to its id ("bytes:\\xNN" for a byte that is no character)."""
    if token.startswith("bytes:"):
        (value,) = bytes.fromhex(token.removeprefix("bytes:").replace("\\x", ""))
        return value
    (value,) = token.encode()
    return value


def completion_ids(choice: Any) -> list[int]:
    """A completions choice's generated token ids, exactly (its text drops bytes that are no
    character), read from its logprobs."""
    return [token_id(t) for t in choice.logprobs.tokens]


def check_position(log_softmax: torch.Tensor, token: int, logprob: float, top: dict[int, float]) -> None:
    """One position's logprob, and its top logprobs, against HF's log-softmax row."""
    assert abs(float(log_softmax[token]) - logprob) < ATOL, (token, logprob, float(log_softmax[token]))
    for other, value in top.items():
        assert abs(float(log_softmax[other]) - value) < ATOL, (other, value)
    best = sorted(top.values(), reverse=True)[:TOP]
    assert torch.allclose(torch.tensor(best), torch.topk(log_softmax, TOP).values, atol=ATOL)


def merge_completion_logprobs(chunks: list[Any]) -> dict[str, list[Any]]:
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                for key, values in merged.items():
                    values.extend(getattr(choice.logprobs, key) or [])
    return merged


# -- logprobs against HF ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_with_echo_equal_hf_log_softmax(server: Server, stream: bool) -> None:
    client = server.openai()
    prompt = prompt_text(31, 8)
    kwargs: dict[str, Any] = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0.0,
        "logprobs": TOP,
        "echo": True,
        "extra_body": NO_EOS,
    }
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        logprobs = merge_completion_logprobs(chunks)
    else:
        result = client.completions.create(**kwargs)
        text = result.choices[0].text
        logprobs = result.choices[0].logprobs.model_dump()
    prompt_ids = TOKENIZER.encode(prompt)
    ids = [token_id(t) for t in logprobs["tokens"]]
    assert ids[: len(prompt_ids)] == prompt_ids and len(ids) == len(prompt_ids) + 6
    # the text is the prompt and the completion's whole characters (bytes that complete none are held back)
    assert text.startswith(prompt) and TOKENIZER.decode(ids).startswith(text)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == list(range(len(ids)))  # one ASCII character per token here
    reference = hf_log_softmax(server, ids)
    for i in range(1, len(ids)):
        top = {token_id(t): v for t, v in logprobs["top_logprobs"][i].items()}
        check_position(reference[i - 1], ids[i], logprobs["token_logprobs"][i], top)
    generated = ids[len(prompt_ids) :]
    assert generated == [int(reference[i - 1].argmax()) for i in range(len(prompt_ids), len(ids))]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_hf_log_softmax(server: Server, stream: bool) -> None:
    client = server.openai()
    messages = [{"role": "user", "content": prompt_text(32, 6)}]
    kwargs: dict[str, Any] = {
        "model": server.model,
        "messages": messages,
        "max_tokens": 5,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": TOP,
        "extra_body": NO_EOS,
    }
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == 5
    prompt_ids = TOKENIZER.chat_token_ids(messages)
    ids = prompt_ids + [entry.bytes[0] for entry in content]
    reference = hf_log_softmax(server, ids)
    for k, entry in enumerate(content):
        assert len(entry.bytes) == 1 and len(entry.top_logprobs) == TOP
        top = {alt.bytes[0]: alt.logprob for alt in entry.top_logprobs}
        check_position(reference[len(prompt_ids) + k - 1], entry.bytes[0], entry.logprob, top)
        assert [alt.logprob for alt in entry.top_logprobs] == sorted(top.values(), reverse=True)


# -- n, seeds, best_of, echo --------------------------------------------------------------------------


def test_n_4_at_temperature_0_gives_four_identical_choices(server: Server) -> None:
    client = server.openai()
    prompt = prompt_text(41, 10)
    result = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=8, temperature=0.0, n=4, extra_body=NO_EOS
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert len({c.text for c in result.choices}) == 1
    assert result.usage.prompt_tokens == len(TOKENIZER.encode(prompt))  # the prompt once
    assert result.usage.completion_tokens == 4 * 8

    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=6,
        temperature=0.0,
        n=4,
        extra_body=NO_EOS,
    )
    assert [c.index for c in chat.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in chat.choices}) == 1


def test_n_with_several_prompts_streamed_numbers_choices_prompt_major(server: Server) -> None:
    client = server.openai()
    prompts = [prompt_text(42, 7), prompt_text(43, 12)]
    whole = client.completions.create(
        model=server.model, prompt=prompts, max_tokens=6, temperature=0.0, n=2, extra_body=NO_EOS
    )
    singles = [
        client.completions.create(model=server.model, prompt=p, max_tokens=6, temperature=0.0, extra_body=NO_EOS)
        .choices[0]
        .text
        for p in prompts
    ]
    assert [(c.index, c.text) for c in whole.choices] == [
        (0, singles[0]),
        (1, singles[0]),
        (2, singles[1]),
        (3, singles[1]),
    ]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(
        model=server.model, prompt=prompts, max_tokens=6, temperature=0.0, n=2, stream=True, extra_body=NO_EOS
    ):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}


def test_sample_j_of_a_seeded_request_uses_seed_plus_j(server: Server) -> None:
    client = server.openai()
    kwargs: dict[str, Any] = {
        "model": server.model,
        "prompt": prompt_text(44, 9),
        "max_tokens": 10,
        "temperature": 1.0,
        "extra_body": NO_EOS,
    }
    fanned = client.completions.create(n=3, seed=500, **kwargs)
    singles = [client.completions.create(seed=500 + j, **kwargs).choices[0].text for j in range(3)]
    assert [c.text for c in fanned.choices] == singles
    assert len(set(singles)) > 1  # different seeds sample differently (temperature 1, 10 tokens)


def test_best_of_returns_the_sample_with_the_highest_cumulative_logprob(server: Server) -> None:
    client = server.openai()
    kwargs: dict[str, Any] = {
        "model": server.model,
        "prompt": prompt_text(45, 9),
        "max_tokens": 8,
        "temperature": 1.0,
        "logprobs": 1,
        "extra_body": NO_EOS,
    }
    best = client.completions.create(best_of=3, seed=900, **kwargs)
    candidates = [client.completions.create(seed=900 + j, **kwargs).choices[0] for j in range(3)]
    winner = max(candidates, key=lambda c: sum(c.logprobs.token_logprobs))
    assert len(best.choices) == 1 and best.choices[0].text == winner.text
    assert best.choices[0].logprobs.token_logprobs == pytest.approx(winner.logprobs.token_logprobs, abs=1e-6)
    assert best.usage.completion_tokens == 3 * 8


def test_echo_returns_the_prompt_and_the_completion(server: Server) -> None:
    client = server.openai()
    prompt = prompt_text(46, 6)
    kwargs: dict[str, Any] = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 5,
        "temperature": 0.0,
        "extra_body": NO_EOS,
    }
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(echo=True, **kwargs).choices[0].text == prompt + plain
    streamed = client.completions.create(echo=True, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt + plain


# -- penalties, logit_bias, min_p against a direct computation on HF's logits -------------------------


def no_change(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
    return logits


def presence(penalty: float) -> Adjust:
    def adjust(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        for token in set(out):
            logits[token] -= penalty
        return logits

    return adjust


def frequency(penalty: float) -> Adjust:
    def adjust(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        for token in out:
            logits[token] -= penalty
        return logits

    return adjust


def repetition(penalty: float) -> Adjust:
    def adjust(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        for token in set(prompt) | set(out):
            logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
        return logits

    return adjust


def bias(biases: dict[int, float]) -> Adjust:
    def adjust(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        for token, value in biases.items():
            logits[token] += value
        return logits

    return adjust


PENALTY_CASES: list[tuple[str, dict[str, Any], Adjust]] = [
    ("presence", {"presence_penalty": 2.0}, presence(2.0)),
    ("frequency", {"frequency_penalty": 1.5}, frequency(1.5)),
    ("repetition", {"extra_body": {**NO_EOS, "repetition_penalty": 1.8}}, repetition(1.8)),
]


@pytest.mark.parametrize(("name", "fields", "adjust"), PENALTY_CASES, ids=[c[0] for c in PENALTY_CASES])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_penalty_changes_greedy_tokens_as_computed_on_hf_logits(
    server: Server, route: str, name: str, fields: dict[str, Any], adjust: Adjust
) -> None:
    client = server.openai()
    text = prompt_text(51, 5)
    kwargs: dict[str, Any] = {
        "model": server.model,
        "max_tokens": 10,
        "temperature": 0.0,
        "extra_body": NO_EOS,
        **fields,
    }
    if route == "chat":
        messages = [{"role": "user", "content": text}]
        prompt = TOKENIZER.chat_token_ids(messages)
        reply = client.chat.completions.create(messages=messages, logprobs=True, **kwargs).choices[0]
        got = [entry.bytes[0] for entry in reply.logprobs.content]
    else:
        prompt = TOKENIZER.encode(text)
        got = completion_ids(client.completions.create(prompt=text, logprobs=0, **kwargs).choices[0])
    expected = hf_greedy(server, prompt, 10, adjust)
    assert expected != hf_greedy(server, prompt, 10, no_change), f"{name} changes nothing on this prompt"
    assert got == expected


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_plus_100_makes_every_greedy_token_that_token(server: Server, stream: bool) -> None:
    client = server.openai()
    q = ord("Q")
    kwargs: dict[str, Any] = {
        "model": server.model,
        "prompt": prompt_text(52, 6),
        "max_tokens": 7,
        "temperature": 0.0,
        "logit_bias": {str(q): 100},
        "extra_body": NO_EOS,
    }
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert text == "Q" * 7


def test_a_negative_logit_bias_moves_greedy_tokens_as_computed(server: Server) -> None:
    client = server.openai()
    text = prompt_text(53, 6)
    prompt = TOKENIZER.encode(text)
    plain = hf_greedy(server, prompt, 8, no_change)
    banned = {plain[0]: -100.0, plain[1]: -30.0}
    expected = hf_greedy(server, prompt, 8, bias(banned))
    assert expected != plain
    result = client.completions.create(
        model=server.model,
        prompt=text,
        max_tokens=8,
        temperature=0.0,
        logprobs=0,
        logit_bias={str(t): b for t, b in banned.items()},
        extra_body=NO_EOS,
    )
    assert completion_ids(result.choices[0]) == expected


def test_min_p_1_keeps_only_the_most_likely_token(server: Server) -> None:
    client = server.openai()
    kwargs: dict[str, Any] = {"model": server.model, "prompt": prompt_text(54, 8), "max_tokens": 8}
    greedy = client.completions.create(temperature=0.0, extra_body=NO_EOS, **kwargs).choices[0].text
    for seed in (1, 2, 3):
        hot = client.completions.create(temperature=1.5, seed=seed, extra_body={**NO_EOS, "min_p": 1.0}, **kwargs)
        assert hot.choices[0].text == greedy


# -- structured output ------------------------------------------------------------------------------


def test_guided_choice_returns_one_of_the_choices(server: Server) -> None:
    client = server.openai()
    choices = ["alpha", "omega", "kappa"]
    for seed in range(3):
        extra = {"guided_choice": choices}
        result = client.completions.create(
            model=server.model,
            prompt=prompt_text(60 + seed, 5),
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body=extra,
        )
        assert result.choices[0].text in choices


def test_response_format_json_schema_returns_valid_json(server: Server) -> None:
    client = server.openai()
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "colour?"}],
        max_tokens=40,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content)["colour"] in ("red", "green")


def test_response_format_json_object_returns_parseable_json(server: Server) -> None:
    """The mask forces a JSON object; a +100 bias on ``}`` closes it as soon as the grammar lets it
    (without the mask the bias alone would give ``}}}}...``)."""
    client = server.openai()
    reply = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=40,
        temperature=0.0,
        response_format={"type": "json_object"},
        logit_bias={str(ord("}")): 100},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
