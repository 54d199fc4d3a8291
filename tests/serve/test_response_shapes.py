"""The HTTP layer's new fields without a server: request bodies map to the engine's
``SamplingParams`` (or a 400 naming the field and value), and ``Generation`` turns constructed
``Delta`` / ``ClusterCompletion`` objects into OpenAI's response and stream shapes: ``n`` and
``best_of`` fan-out and choice numbering, seeds per sample, usage, ``echo`` and logprobs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.results import ClusterCompletion, Delta
from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.tokenizer import ByteTokenizer
from engine.validation import ValidatedPrompt
from serving.completions import Admission, Generation
from serving.errors import APIError
from serving.logprob_format import TokenStrings
from serving.metrics import ServeMetrics
from serving.protocol import ChatCompletionRequest, CompletionRequest, describe

MODEL = "tiny"
VOCAB = 256


@dataclass(frozen=True)
class FakeModel:
    tokenizer: ByteTokenizer
    vocab_size: int = VOCAB
    max_model_len: int = 512

    def prompt_text(self, prompt: ValidatedPrompt) -> str:  # as ServedModel.prompt_text
        return prompt.text if prompt.text is not None else self.tokenizer.decode(list(prompt.token_ids))


class FakeCluster:
    """Answers each request with tokens that depend on its seed only: sample ``s`` writes the
    byte ``b"a"[0] + s % 20`` ``max_tokens`` times (with logprob ``-0.1 * (s % 20 + 1)`` each, so a
    smaller seed has the higher cumulative logprob unless ``best`` says otherwise), one delta per
    token, and reports every logprob the sampling asked for."""

    def __init__(self, best_seed: int | None = None, send_logprobs: bool = True):
        self.model = FakeModel(ByteTokenizer())
        self.best_seed = best_seed
        self.send_logprobs = send_logprobs
        self.calls: list[tuple[tuple[int, ...], SamplingParams]] = []
        self.placements: list[str | None] = []  # each call's share_placement key

    def _logprob(self, seed: int) -> float:
        return -0.01 if seed == self.best_seed else -0.1 * (seed % 20 + 1)

    async def agenerate(
        self,
        prompt: ValidatedPrompt,
        sampling: SamplingParams,
        *,
        request_id: str,
        on_delta: Callable[[Delta], None],
        share_placement: str | None = None,
    ) -> ClusterCompletion:
        self.calls.append((prompt.token_ids, sampling))
        self.placements.append(share_placement)
        seed = sampling.seed or 0
        token = ord("a") + seed % 20
        top = tuple((token + k, self._logprob(seed) - k) for k in range(sampling.logprobs or 0))
        entries = [TokenLogprob(token, self._logprob(seed), 1, top) for _ in range(sampling.max_tokens)]
        for entry in entries:
            await asyncio.sleep(0)
            on_delta(
                Delta(chr(token), 1, (token,), (entry,) if self.send_logprobs and sampling.logprobs is not None else ())
            )
        prompt_logprobs: list[TokenLogprob | None] | None = None
        if sampling.prompt_logprobs is not None:
            k = sampling.prompt_logprobs
            prompt_logprobs = [None] + [
                TokenLogprob(t, -1.5, 3, tuple((t ^ 1, -1.0 - j) for j in range(k))) for t in prompt.token_ids[1:]
            ]
        return ClusterCompletion(
            prompt.text or "",
            chr(token) * sampling.max_tokens,
            [token] * sampling.max_tokens,
            "length",
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            cached_tokens=2,
            logprobs=entries if self.send_logprobs and sampling.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
        )


def generation(cluster: FakeCluster) -> Generation:
    return Generation(cluster, MODEL, ServeMetrics(), Admission(64, 1))  # type: ignore[arg-type]  # a stand-in cluster


def complete(cluster: FakeCluster, **fields: Any) -> dict[str, Any]:
    gen = generation(cluster)
    body = CompletionRequest.model_validate({"model": MODEL, "max_tokens": 3, **fields})
    result = asyncio.run(gen.respond(gen.prepare_completion(body)))
    assert isinstance(result, dict)
    return result


def chat(cluster: FakeCluster, **fields: Any) -> dict[str, Any]:
    gen = generation(cluster)
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "max_tokens": 3, **fields, "messages": [{"role": "user", "content": "hi"}]}
    )
    result = asyncio.run(gen.respond(gen.prepare_chat(body)))
    assert isinstance(result, dict)
    return result


def stream_events(cluster: FakeCluster, chat_route: bool, **fields: Any) -> list[dict[str, Any]]:
    gen = generation(cluster)
    if chat_route:
        body: Any = ChatCompletionRequest.model_validate(
            {"model": MODEL, "max_tokens": 3, "stream": True, **fields, "messages": [{"role": "user", "content": "hi"}]}
        )
        prepared = gen.prepare_chat(body)
    else:
        body = CompletionRequest.model_validate({"model": MODEL, "max_tokens": 3, "stream": True, **fields})
        prepared = gen.prepare_completion(body)

    async def collect() -> list[str]:
        events = await gen.respond(prepared)
        assert not isinstance(events, dict)
        return [line async for line in events]

    lines = [line for line in asyncio.run(collect()) if line]
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# -- n, best_of, seeds, usage -----------------------------------------------------------------------


def test_n_samples_per_prompt_are_numbered_prompt_major_with_seed_plus_j() -> None:
    cluster = FakeCluster()
    result = complete(cluster, prompt=["ab", "cde"], n=3, seed=5, temperature=1.0)
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3, 4, 5]
    assert [c["text"] for c in result["choices"]] == [chr(ord("a") + s) * 3 for s in (5, 6, 7)] * 2
    assert [s.seed for _, s in cluster.calls].count(5) == 2 and len(cluster.calls) == 6
    assert result["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 18,
        "total_tokens": 23,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_the_samples_of_one_prompt_share_a_placement_and_other_prompts_do_not() -> None:
    cluster = FakeCluster()
    complete(cluster, prompt=["ab", "cde"], n=3)
    first, second = cluster.placements[:3], cluster.placements[3:]
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0] and None not in first
    single = FakeCluster()
    complete(single, prompt=["ab", "cde"])
    assert single.placements == [None, None]


def test_n_without_a_seed_leaves_every_sample_unseeded() -> None:
    cluster = FakeCluster()
    complete(cluster, prompt="ab", n=2)
    assert [s.seed for _, s in cluster.calls] == [None, None]


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob() -> None:
    cluster = FakeCluster(best_seed=12)
    result = complete(cluster, prompt="ab", n=2, best_of=4, seed=10, temperature=1.0)
    assert len(cluster.calls) == 4 and all(s.logprobs == 0 for _, s in cluster.calls)
    # seed 12 was made best; of the rest, seed 10 has the highest (-0.1 * 11 per token)
    assert [c["text"] for c in result["choices"]] == [chr(ord("a") + 12) * 3, chr(ord("a") + 10) * 3]
    assert [c["index"] for c in result["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in result["choices"])  # ranked by logprobs nobody asked to see
    assert result["usage"]["completion_tokens"] == 12  # every sample's tokens were generated


def test_a_sample_count_over_the_queue_bound_is_a_400_naming_n() -> None:
    gen = Generation(FakeCluster(), MODEL, ServeMetrics(), Admission(4, 1))  # type: ignore[arg-type]
    body = CompletionRequest.model_validate({"model": MODEL, "prompt": ["a", "b"], "n": 3})
    with pytest.raises(APIError) as caught:
        asyncio.run(gen.respond(gen.prepare_completion(body)))
    assert caught.value.status == 400 and caught.value.param == "n"
    assert "queue bound of 4" in caught.value.message


# -- logprobs and echo --------------------------------------------------------------------------------


def test_completion_logprobs_have_openai_legacy_shape() -> None:
    result = complete(FakeCluster(), prompt="ab", logprobs=2, seed=1)
    logprobs = result["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["b", "b", "b"]
    assert logprobs["token_logprobs"] == pytest.approx([-0.2] * 3)
    assert logprobs["top_logprobs"] == [pytest.approx({"b": -0.2, "c": -1.2})] * 3
    assert logprobs["text_offset"] == [0, 1, 2]


def test_logprobs_0_still_reports_the_sampled_token() -> None:
    logprobs = complete(FakeCluster(), prompt="ab", logprobs=0)["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [pytest.approx({"a": -0.1})] * 3


def test_echo_puts_the_prompt_and_its_logprobs_first() -> None:
    result = complete(FakeCluster(), prompt="xyz", echo=True, logprobs=1)
    choice = result["choices"][0]
    assert choice["text"] == "xyz" + "aaa"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["x", "y", "z", "a", "a", "a"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:3] == [-1.5, -1.5]
    assert logprobs["top_logprobs"][1] == {"y": -1.5, "x": -1.0}  # y ^ 1 is x
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert result["usage"]["prompt_tokens"] == 3 and result["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt_and_generates_nothing(stream: bool) -> None:
    fields = {"prompt": ["xyz", "pq"], "echo": True, "logprobs": 1, "max_tokens": 0}
    cluster = FakeCluster()
    scored = complete(cluster, **fields)
    assert [s.max_tokens for _, s in cluster.calls] == [1, 1]  # the engine runs one token per prompt
    with_one = complete(FakeCluster(), **{**fields, "max_tokens": 1})
    for choice, longer in zip(scored["choices"], with_one["choices"], strict=True):
        assert choice["text"] == longer["text"][:-1] and choice["finish_reason"] == "length"
        assert choice["logprobs"] == {key: values[:-1] for key, values in longer["logprobs"].items()}
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == 5
    if stream:
        events = stream_events(FakeCluster(), False, **fields, stream_options={"include_usage": True})
        by_index: dict[int, list[dict[str, Any]]] = {}
        for event in events[:-1]:
            by_index.setdefault(event["choices"][0]["index"], []).append(event["choices"][0])
        for choice in scored["choices"]:
            chunks = by_index[choice["index"]]
            assert "".join(c["text"] for c in chunks) == choice["text"]
            assert chunks[-1]["finish_reason"] == "length"
            merged = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]] for k in choice["logprobs"]}
            assert merged == choice["logprobs"]
        assert events[-1]["usage"]["completion_tokens"] == 0


def test_max_tokens_0_without_echo_is_a_400_naming_it() -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"model": MODEL, "prompt": "ab", "max_tokens": 0})
    param, message = describe(caught.value)
    assert param == "max_tokens" and "echo" in message and "(got 0)" in message
    with pytest.raises(ValidationError) as chat_caught:
        ChatCompletionRequest.model_validate(
            {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}
        )
    assert describe(chat_caught.value)[0] == "max_tokens"


def test_echo_without_logprobs_is_text_only() -> None:
    cluster = FakeCluster()
    choice = complete(cluster, prompt="xyz", echo=True)["choices"][0]
    assert choice["text"] == "xyzaaa" and choice["logprobs"] is None
    assert cluster.calls[0][1].prompt_logprobs is None


def test_chat_logprobs_have_openai_shape_with_bytes() -> None:
    result = chat(FakeCluster(), logprobs=True, top_logprobs=2, seed=3)
    content = result["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert content[0] == {
        "token": "d",
        "logprob": pytest.approx(-0.4),
        "bytes": [100],
        "top_logprobs": [
            {"token": "d", "logprob": pytest.approx(-0.4), "bytes": [100]},
            {"token": "e", "logprob": pytest.approx(-1.4), "bytes": [101]},
        ],
    }


def test_chat_logprobs_without_top_logprobs_give_empty_alternatives() -> None:
    cluster = FakeCluster()
    content = chat(cluster, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in content] == [[], [], []]
    assert cluster.calls[0][1].logprobs == 0


def test_a_byte_that_is_no_character_is_named_by_its_bytes() -> None:
    strings = TokenStrings(ByteTokenizer())
    assert strings.of(0xC3) == ("bytes:\\xc3", b"\xc3")
    assert strings.of("é".encode()[1]) == ("bytes:\\xa9", b"\xa9")
    assert strings.of(ord("Q")) == ("Q", b"Q")


def test_missing_logprobs_from_the_cluster_are_a_500() -> None:
    with pytest.raises(APIError) as caught:
        complete(FakeCluster(send_logprobs=False), prompt="ab", logprobs=1)
    assert caught.value.status == 500 and "no logprobs" in caught.value.message


# -- streams -------------------------------------------------------------------------------------------


def test_a_streamed_completion_with_n_and_logprobs_matches_the_whole_response() -> None:
    fields = {"prompt": ["ab", "c"], "n": 2, "seed": 4, "logprobs": 1}
    whole = complete(FakeCluster(), **fields)
    events = stream_events(FakeCluster(), False, **fields)
    texts: dict[int, str] = {}
    logprobs: dict[int, dict[str, list[Any]]] = {}
    for event in events:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        for key, values in (choice["logprobs"] or {}).items():
            logprobs.setdefault(choice["index"], {}).setdefault(key, []).extend(values)
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert logprobs == {c["index"]: c["logprobs"] for c in whole["choices"]}
    finishes = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2, 3]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_streamed_echo_sends_the_prompt_first_for_each_choice(logprobs: int | None) -> None:
    fields = {"prompt": "xyz", "n": 2, "echo": True, "logprobs": logprobs, "seed": 0}
    whole = complete(FakeCluster(), **fields)
    events = stream_events(FakeCluster(), False, **fields)
    by_index: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        by_index.setdefault(event["choices"][0]["index"], []).append(event["choices"][0])
    for choice in whole["choices"]:
        chunks = by_index[choice["index"]]
        assert chunks[0]["text"] == "xyz"
        assert "".join(c["text"] for c in chunks) == choice["text"]
        if logprobs is not None:
            merged = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]] for k in choice["logprobs"]}
            assert merged == choice["logprobs"]


def test_a_streamed_chat_with_n_opens_each_choice_with_the_role() -> None:
    events = stream_events(
        FakeCluster(), True, n=2, seed=1, logprobs=True, top_logprobs=1, stream_options={"include_usage": True}
    )
    roles = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    content: dict[int, list[Any]] = {}
    for event in events:
        for choice in event["choices"]:
            content.setdefault(choice["index"], []).extend((choice["logprobs"] or {}).get("content", []))
    assert [e["token"] for e in content[1]] == ["c", "c", "c"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    rendered = ByteTokenizer().chat_token_ids([{"role": "user", "content": "hi"}])
    assert events[-1]["usage"]["prompt_tokens"] == len(rendered)


# -- request bodies -------------------------------------------------------------------------------------


def sampling_of(fields: dict[str, Any], chat_route: bool = False) -> SamplingParams:
    if chat_route:
        body: Any = ChatCompletionRequest.model_validate(
            {"model": MODEL, **fields, "messages": [{"role": "user", "content": "x"}]}
        )
    else:
        body = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", **fields})
    return body.sampling(4)


def test_every_sampling_field_reaches_sampling_params() -> None:
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.3,
        "min_p": 0.1,
        "logit_bias": {"65": 100, "7": -2.5},
        "logprobs": 3,
        "echo": True,
    }
    sampling = sampling_of(fields)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.0, 1.3)
    assert sampling.min_p == 0.1 and dict(sampling.logit_bias) == {65: 100.0, 7: -2.5}
    assert (sampling.logprobs, sampling.prompt_logprobs) == (3, 3)
    chat_sampling = sampling_of({"logprobs": True, "top_logprobs": 5}, chat_route=True)
    assert (chat_sampling.logprobs, chat_sampling.prompt_logprobs) == (5, None)
    neutral = sampling_of({})
    assert neutral == SamplingParams(max_tokens=4, temperature=1.0)


@pytest.mark.parametrize(
    ("fields", "structured"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput(kind="json_object")),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}},
            StructuredOutput(kind="json_schema", spec='{"type":"object"}'),
        ),
        ({"guided_json": '{"type": "integer"}'}, StructuredOutput(kind="json_schema", spec='{"type":"integer"}')),
        ({"guided_regex": "[0-9]+"}, StructuredOutput(kind="regex", spec="[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput(kind="choice", spec='["yes", "no"]')),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutput(kind="grammar", spec='root ::= "a"')),
        ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput(kind="choice", spec='["x"]')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput(kind="json_object")),
    ],
)
def test_structured_output_fields_become_one_constraint(fields: dict[str, Any], structured: Any) -> None:
    assert sampling_of(fields).structured == structured
    assert sampling_of(fields, chat_route=True).structured == structured


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
    ],
)
def test_the_field_holding_a_spec_is_named_for_its_errors(fields: dict[str, Any], param: str) -> None:
    assert CompletionRequest.model_validate({"model": MODEL, "prompt": "x", **fields}).structured_param == param


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"n": 0}, "n", ">= 1"),
    ({"n": 129}, "n", "<= 128"),
    ({"logprobs": 21}, "logprobs", "<= 20"),
    ({"logprobs": True}, "logprobs", "integer"),
    ({"best_of": 1, "n": 2}, "best_of", "must be >= n (2) (got 1)"),
    ({"best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
    ({"presence_penalty": 2.5}, "presence_penalty", "<= 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", ">= -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"min_p": 1.5}, "min_p", "<= 1"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "'abc'"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100] (got 101)"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", "(got '1')"),
    ({"logit_bias": {"-5": 1}}, "logit_bias", "'-5'"),
    ({"suffix": "z"}, "suffix", "not supported"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "None"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
        "response_format.json_schema.name",
        "'a b'",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}},
        "response_format.json_schema.schema",
        "(got 3)",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "scheme": {}}}},
        "response_format.json_schema.scheme",
        "unknown field",
    ),
    ({"guided_json": "{nope"}, "guided_json", "'{nope'"),
    ({"guided_regex": ""}, "guided_regex", "non-empty regular expression"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty list"),
    ({"guided_grammar": ""}, "guided_grammar", "non-empty grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml", "unknown field"),
    (
        {"guided_regex": "a", "response_format": {"type": "json_object"}},
        "guided_regex",
        "only one structured-output field at a time (also got response_format)",
    ),
]


@pytest.mark.parametrize(("fields", "param", "fragment"), BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_a_bad_field_is_refused_naming_it(fields: dict[str, Any], param: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"model": MODEL, "prompt": "x", **fields})
    name, message = describe(caught.value)
    assert name == param
    assert message.startswith(f"{param}: ") and fragment in message, message


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs=true (got 2)"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "<= 20"),
        ({"logprobs": 1}, "logprobs", "true or false"),
        ({"n": 0}, "n", ">= 1"),
    ],
)
def test_a_bad_chat_field_is_refused_naming_it(fields: dict[str, Any], param: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields})
    name, message = describe(caught.value)
    assert name == param and fragment in message, message


def test_a_logit_bias_token_outside_the_vocabulary_is_a_400_naming_it() -> None:
    with pytest.raises(APIError) as caught:
        complete(FakeCluster(), prompt="ab", logit_bias={"256": 5})
    assert caught.value.status == 400 and caught.value.param == "logit_bias"
    assert caught.value.message == "logit_bias: token id 256 is outside the vocabulary [0, 256)"
