"""The OpenAI-compatible API through the real ``openai`` client: completions and chat, streamed
and not, against the single engine (``engine.LLM``) as the oracle, usage against the tokenizer,
cached tokens on a repeated prefix, 64 concurrent streams, a client that disconnects."""

from __future__ import annotations

import asyncio
import functools
import random
import time
from typing import Any

import openai
import pytest

from configs import ClusterConfig
from engine import LLM, SamplingParams
from engine.tokenizer import ByteTokenizer
from tests.oracle import MIN_MARGIN, greedy_references
from tests.serve.conftest import Server, all_blocks_free, logged_since, server_log_files, wait_for

MAX_TOKENS = 12
WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta", "zeta", "rho"]


def prompt_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def oracle(config: ClusterConfig, prompts: tuple[str, ...], max_tokens: int) -> list[Any]:
    """The single engine's greedy completions (same model and KV config, one process)."""
    return _oracle(config.model_dump_json(), prompts, max_tokens)


@functools.cache
def _oracle(config_json: str, prompts: tuple[str, ...], max_tokens: int) -> list[Any]:
    llm = LLM(ClusterConfig.model_validate_json(config_json))
    try:
        return list(llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    finally:
        llm.engine.close()


GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_models_lists_the_served_model(server: Server) -> None:
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [server.model]


@pytest.mark.parametrize("words", [3, 12, 40])
def test_completion_equals_the_single_engine_streamed_or_not(server: Server, words: int) -> None:
    client = server.openai()
    prompt = prompt_text(words, words)
    (expected,) = oracle(server.config, (prompt,), MAX_TOKENS)
    whole = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, **GREEDY)
    assert whole.choices[0].text == expected.text  # type: ignore[attr-defined]
    assert whole.choices[0].finish_reason == "length"
    prompt_tokens = len(ByteTokenizer().encode(prompt))
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == MAX_TOKENS == len(expected.token_ids)  # type: ignore[attr-defined]
    assert whole.usage.total_tokens == prompt_tokens + MAX_TOKENS

    stream = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, MAX_TOKENS)


def test_token_id_prompts_and_a_batch_of_prompts(server: Server) -> None:
    client = server.openai()
    texts = (prompt_text(101, 20), prompt_text(102, 6))
    expected = oracle(server.config, texts, MAX_TOKENS)
    ids = [ByteTokenizer().encode(t) for t in texts]
    batch = client.completions.create(model=server.model, prompt=[ids[0], texts[1]], max_tokens=MAX_TOKENS, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [e.text for e in expected]  # type: ignore[attr-defined]
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert batch.usage.completion_tokens == 2 * MAX_TOKENS


def test_chat_uses_the_model_chat_template(server: Server) -> None:
    client = server.openai()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt_text(7, 9)}]
    rendered = ByteTokenizer().chat_token_ids(messages)
    (expected,) = oracle(server.config, (ByteTokenizer().decode(rendered),), MAX_TOKENS)
    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS, **GREEDY)  # type: ignore[arg-type]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text  # type: ignore[attr-defined]
    assert whole.usage.prompt_tokens == len(rendered)
    assert whole.usage.completion_tokens == MAX_TOKENS

    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )  # type: ignore[arg-type]
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_raw_stream_is_openai_server_sent_events(server: Server) -> None:
    import httpx

    body = {"model": server.model, "prompt": "raw events", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_a_repeated_prefix_reports_cached_tokens(server: Server) -> None:
    client = server.openai()
    shared = prompt_text(555, 30)
    first = client.completions.create(model=server.model, prompt=shared + " one", max_tokens=2, **GREEDY)
    second = client.completions.create(model=server.model, prompt=shared + " two", max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    block = server.config.kv_cache.block_size
    shared_blocks = len(ByteTokenizer().encode(shared)) // block * block
    assert second.usage.prompt_tokens_details.cached_tokens >= shared_blocks - block > 0


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_cache_salt_separates_cached_prefixes(server: Server, route: str) -> None:
    """vLLM's ``cache_salt``: the same prompt and salt again hits the cache; another salt (or
    none) shares nothing with it and decodes the same tokens."""
    client = server.openai()
    text = prompt_text(777 if route == "chat" else 778, 40)

    def run(salt: str | None) -> tuple[int, str]:
        extra = {"ignore_eos": True, **({"cache_salt": salt} if salt is not None else {})}
        kwargs: dict[str, Any] = {"model": server.model, "max_tokens": 4, "temperature": 0.0, "extra_body": extra}
        if route == "chat":
            chat = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kwargs)
            return chat.usage.prompt_tokens_details.cached_tokens, chat.choices[0].message.content
        done = client.completions.create(prompt=text, **kwargs)
        return done.usage.prompt_tokens_details.cached_tokens, done.choices[0].text

    first, again, other, plain = run("tenant-a"), run("tenant-a"), run("tenant-b"), run(None)
    assert first[0] == 0 and again[0] > 0, (first, again)
    assert other[0] == 0 and plain[0] == 0, (other, plain)
    assert first[1] == again[1] == other[1] == plain[1]


def test_an_empty_cache_salt_is_a_400_naming_it(server: Server) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=server.model, prompt="x", max_tokens=1, extra_body={"cache_salt": ""})
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "cache_salt"  # type: ignore[index]
    assert caught.value.body["message"] == "cache_salt: must be a non-empty string (got '')"  # type: ignore[index]


def test_sampling_with_a_seed_is_reproducible(server: Server) -> None:
    client = server.openai()
    kwargs = {
        "model": server.model,
        "prompt": prompt_text(9, 8),
        "max_tokens": 10,
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": 1234,
        "extra_body": {"top_k": 20, "ignore_eos": True},
    }
    texts = {client.completions.create(**kwargs).choices[0].text for _ in range(3)}
    assert len(texts) == 1


def test_stop_string_ends_the_completion(server: Server) -> None:
    client = server.openai()
    prompt = prompt_text(11, 10)
    (expected,) = oracle(server.config, (prompt,), MAX_TOKENS)
    text = expected.text  # type: ignore[attr-defined]
    stop = text[4:6]
    if not stop or "\ufffd" in stop:
        pytest.skip("the oracle text has no usable stop string")  # never for this seed; guards the oracle
    result = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, stop=[stop], **GREEDY)
    assert result.choices[0].text == text[: text.index(stop)]
    assert result.choices[0].finish_reason == "stop"


# One seed per prompt length (10, 13, ..., 55 words) for the 64-stream test, chosen so that every
# greedy output is printable ASCII with at least two distinct tokens (its text determines its
# tokens, so comparing text compares every token) and no near-tie (every oracle margin >= 0.02).
STREAM_SEEDS = (2048, 2001, 2306, 2003, 2788, 3029, 2326, 2135, 2120, 2121, 2250, 2251, 2156, 2125, 2238, 2063)


def test_64_concurrent_streams_complete_exactly_with_no_block_leak(server: Server) -> None:
    """64 streams at once (16 prompts of 56-311 tokens, 4 copies each, P/D over the local backend)
    give exactly the single engine's text, and every block comes back.

    The comparison is exact, and its validity is asserted rather than assumed: at every generated
    position the oracle's top-1 logit leads the runner-up by more than ``MIN_MARGIN`` (batch
    composition moves fp32 logits by ~1e-6, so no greedy token can flip), and every oracle text
    encodes back to its token ids. A CI run once failed here with identical tokens: the worker
    had coalesced two queued tokens (98, 132) into one chunk and the detokenizer held back the
    whole chunk behind the stray byte for good; the text is now a function of the token ids
    (tests/engine/test_llm.py has that case)."""
    tokenizer = ByteTokenizer()
    distinct = tuple(prompt_text(seed, 10 + k * 3) for k, seed in enumerate(STREAM_SEEDS))
    references = greedy_references(server.config, [tokenizer.encode(t) for t in distinct], MAX_TOKENS)
    expected: dict[str, str] = {}
    for prompt, reference in zip(distinct, references, strict=True):
        assert reference.min_margin > MIN_MARGIN, (prompt, reference.margins)
        text = tokenizer.decode(list(reference.token_ids))
        assert tokenizer.encode(text) == list(reference.token_ids), (prompt, reference.token_ids)
        expected[prompt] = text
    texts = tuple(distinct[i % len(distinct)] for i in range(64))

    async def run() -> list[str]:
        client = server.async_openai(timeout=120)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, **GREEDY
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return list(await asyncio.gather(*(one(p) for p in texts)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert results == [expected[t] for t in texts]
    wait_for(all_blocks_free(server), 10, "every block back in the pools after 64 streams")


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server: Server) -> None:
    import httpx

    wait_for(all_blocks_free(server), 10, "an idle cluster before the test")
    aborted_before = server.totals()["requests_aborted"]
    logs_before = server_log_files()
    prompt = prompt_text(77, 40)
    max_tokens = server.config.model.max_model_len or 512
    max_tokens -= len(ByteTokenizer().encode(prompt)) + 1
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200
        received = 0
        for line in r.iter_lines():
            received += line.startswith("data: {")
            if received >= 3:
                break
    closed = time.monotonic()
    # the connection is closed here, with the request still generating
    wait_for(all_blocks_free(server), 2.0, "the disconnected request's blocks back in the pool")
    freed_after_s = time.monotonic() - closed
    assert server.totals()["requests_aborted"] > aborted_before, "the request ran to its end instead of aborting"
    assert freed_after_s <= 2.0
    time.sleep(1.0)  # the aborted attempt ends (and would be reported) after the blocks are free
    logged = logged_since(logs_before)
    assert "never retrieved" not in logged and "Traceback" not in logged, logged[-4000:]


def test_the_server_keeps_serving_after_everything_above(server: Server) -> None:
    assert server.get("/health").status_code == 200
    result = server.openai().completions.create(model=server.model, prompt="still here", max_tokens=2)
    assert result.usage.completion_tokens == 2
