"""Token strings come from each token's own bytes, whatever part of a character it holds.

Without a server: ``HFTokenizer.token_bytes`` over a byte-fallback (SentencePiece) and a
byte-level BPE vocabulary (``tests/serve/byte_tokenizers.py``): a text's tokens' bytes join to
its UTF-8, and the logprobs formatting names each token by those bytes with ``text_offset`` in
characters of the text. Through the openai client against the ``bytes`` application (a tiny
random Llama with the byte-fallback vocabulary): an echoed prompt with an emoji and CJK
characters, and a chat reply, streamed or not, with logprobs equal to Hugging Face's.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.logprobs import TokenLogprob
from engine.tokenizer import HFTokenizer
from serving.logprob_format import CompletionLogprobs, TokenStrings, chat_logprobs
from tests.serve.byte_tokenizers import byte_level_bpe, sentencepiece_byte_fallback
from tests.serve.conftest import Server

ATOL = 1e-4  # fp32 logprobs vs HF (tests/model/logits_harness.py)
TOP = 3
TEXTS = ("the cat sat 😀 on 中文 mat", "a😀中b", "😀😀 字 ü!", "ü中")
PROMPT = "the cat sat on the mat 😀 中文 x字"


@functools.cache
def _tokenizer_directory(kind: str, root: str) -> Path:
    directory = Path(root) / kind
    make = sentencepiece_byte_fallback if kind == "sentencepiece" else byte_level_bpe
    make().save_pretrained(str(directory))  # type: ignore[attr-defined]
    return directory


@pytest.fixture(params=["sentencepiece", "byte_level"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    root = tmp_path_factory.getbasetemp() / "token-bytes"
    return HFTokenizer(_tokenizer_directory(request.param, str(root)))


def characters_before(raw: bytes, at: int) -> int:
    """How many whole characters the first ``at`` bytes of valid UTF-8 ``raw`` hold."""
    return len(raw[:at].decode("utf-8", errors="ignore"))


def bytes_of(token: str) -> bytes:
    """A legacy-completions token string back to its bytes (``bytes:\\xNN...`` or its text)."""
    if token.startswith("bytes:"):
        return bytes.fromhex(token.removeprefix("bytes:").replace("\\x", ""))
    return token.encode()


# -- without a server ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_a_texts_tokens_bytes_join_to_its_utf8(tokenizer: HFTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode()
    assert any(len(p) and not _whole_characters(p) for p in pieces), "the text should split a character"
    assert tokenizer.decode(ids) == text


def test_any_run_of_tokens_that_decodes_to_whole_characters_is_its_tokens_bytes(tokenizer: HFTokenizer) -> None:
    """Runs of tokens cut anywhere from encoded texts (a run may start or end inside a
    character): where ``decode`` gives whole characters, they are the run's joined bytes. (Where
    it gives U+FFFD, the tokenizer's own replacement rules decide how many: SentencePiece's byte
    fallback replaces each byte of an invalid run, UTF-8 decoding one per broken sequence.)"""
    pool = ("a", " ", "😀", "中", "ü", "字", "x", " the", "!", "文")
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(300):
        picks = torch.randint(0, len(pool), (int(torch.randint(1, 8, (1,), generator=generator)),), generator=generator)
        ids = tokenizer.encode("".join(pool[i] for i in picks.tolist()))
        start, end = sorted(torch.randint(0, len(ids) + 1, (2,), generator=generator).tolist())
        run = ids[start:end]
        text = tokenizer.decode(run)
        if "\ufffd" not in text:
            assert b"".join(tokenizer.token_bytes(t) for t in run) == text.encode(), run
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("text", TEXTS)
def test_completion_logprobs_name_tokens_by_their_bytes_with_character_offsets(
    tokenizer: HFTokenizer, text: str
) -> None:
    ids = tokenizer.encode(text)
    strings = TokenStrings(tokenizer)
    piece = CompletionLogprobs(strings).prompt(ids, [None] * len(ids))
    assert b"".join(bytes_of(t) for t in piece["tokens"]) == text.encode()
    raw = text.encode()
    starts = [len(b"".join(tokenizer.token_bytes(t) for t in ids[:i])) for i in range(len(ids))]
    assert piece["text_offset"] == [characters_before(raw, at) for at in starts]
    for token, token_id in zip(piece["tokens"], ids, strict=True):
        own = tokenizer.token_bytes(token_id)
        assert token == (own.decode() if _whole_characters(own) else "bytes:" + "".join(f"\\x{b:02x}" for b in own))


def test_chat_logprobs_carry_each_tokens_own_bytes(tokenizer: HFTokenizer) -> None:
    ids = [t for t in tokenizer.encode("😀 中") if tokenizer.token_bytes(t)]
    entries = [TokenLogprob(t, -1.0, 1, ((t, -1.0), (ids[0], -2.0))) for t in ids]
    content = chat_logprobs(TokenStrings(tokenizer), entries, 2)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == "😀 中".encode()
    assert all(e["top_logprobs"][1]["bytes"] == list(tokenizer.token_bytes(ids[0])) for e in content)
    assert "\ufffd" not in "".join(e["token"] for e in content)


def _whole_characters(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- through the openai client against HF ------------------------------------------------------------


@functools.cache
def _hf(directory: str) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoTokenizer

    from tests.model.logits_harness import hf_model

    return hf_model(Path(directory)), AutoTokenizer.from_pretrained(directory)


def hf_log_softmax(server: Server, ids: list[int]) -> torch.Tensor:
    """HF's fp32 log-softmax over the vocabulary at every position of ``ids``."""
    model, _ = _hf(server.config.model.source)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def expected_bytes(server: Server, token_id: int) -> bytes:
    """The token's bytes read from its vocabulary piece (SentencePiece's rules: ``<0xNN>`` is a
    byte, ``▁`` a space; special tokens are skipped in the text, so none)."""
    _, tokenizer = _hf(server.config.model.source)
    if token_id in tokenizer.all_special_ids:
        return b""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:-1], 16)])
    return piece.replace("▁", " ").encode()


def merged_completion_logprobs(chunks: list[Any]) -> dict[str, list[Any]]:
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                for key, values in merged.items():
                    values.extend(getattr(choice.logprobs, key) or [])
    return merged


@pytest.mark.parametrize("stream", [False, True])
def test_an_echoed_prompt_with_emoji_and_cjk_has_its_own_bytes_and_hf_logprobs(
    byte_server: Server, stream: bool
) -> None:
    client = byte_server.openai()
    kwargs: dict[str, Any] = {
        "model": byte_server.model,
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": TOP,
        "echo": True,
    }
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        logprobs = merged_completion_logprobs(chunks)
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, logprobs = choice.text, choice.logprobs.model_dump()
    _, tokenizer = _hf(byte_server.config.model.source)
    prompt_ids = tokenizer.encode(PROMPT)
    assert any(tokenizer.convert_ids_to_tokens(t).startswith("<0x") for t in prompt_ids)  # byte-fallback tokens
    tokens = logprobs["tokens"]
    assert len(tokens) == len(prompt_ids) + 1
    assert b"".join(bytes_of(t) for t in tokens[: len(prompt_ids)]) == PROMPT.encode()
    assert [bytes_of(t) for t in tokens[: len(prompt_ids)]] == [expected_bytes(byte_server, t) for t in prompt_ids]
    assert "bytes:\\xf0" in tokens and "\ufffd" not in "".join(tokens)
    joined = b"".join(bytes_of(t) for t in tokens)
    starts = [len(b"".join(bytes_of(t) for t in tokens[:i])) for i in range(len(tokens))]
    assert text.startswith(PROMPT)
    assert logprobs["text_offset"] == [characters_before(joined, at) for at in starts]
    for i in range(1, len(prompt_ids)):  # each whole-character token sits at its offset in the text
        if _whole_characters(bytes_of(tokens[i])):
            assert text[logprobs["text_offset"][i] :].startswith(tokens[i])
    reference = hf_log_softmax(byte_server, prompt_ids)
    assert logprobs["token_logprobs"][0] is None
    by_bytes: dict[bytes, list[int]] = {}  # "a" and "<0x61>" are two tokens with one string
    for t in range(len(tokenizer)):
        by_bytes.setdefault(expected_bytes(byte_server, t), []).append(t)
    for i in range(1, len(prompt_ids)):
        row = reference[i - 1]
        assert abs(float(row[prompt_ids[i]]) - logprobs["token_logprobs"][i]) < ATOL
        for token, value in logprobs["top_logprobs"][i].items():
            assert any(abs(float(row[t]) - value) < ATOL for t in by_bytes[bytes_of(token)]), token
    top = torch.topk(reference[-1], TOP)
    assert tokens[-1] == TokenStrings(HFTokenizer(Path(byte_server.config.model.source))).text(int(top.indices[0]))
    assert abs(logprobs["token_logprobs"][-1] - float(top.values[0])) < ATOL


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_reply_has_each_tokens_own_bytes_and_hf_logprobs(byte_server: Server, stream: bool) -> None:
    client = byte_server.openai()
    messages = [{"role": "user", "content": "中文 😀 the cat"}]
    kwargs: dict[str, Any] = {
        "model": byte_server.model,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": TOP,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    ids = HFTokenizer(Path(byte_server.config.model.source)).chat_token_ids(messages)
    for entry in content:  # HF's greedy continuation, one position at a time
        row = hf_log_softmax(byte_server, ids)[-1]
        best = torch.topk(row, TOP)
        chosen = int(best.indices[0])
        assert bytes(entry.bytes) == expected_bytes(byte_server, chosen)
        assert abs(entry.logprob - float(best.values[0])) < ATOL
        assert [bytes(a.bytes) for a in entry.top_logprobs] == [
            expected_bytes(byte_server, int(t)) for t in best.indices
        ]
        assert all(abs(a.logprob - float(v)) < ATOL for a, v in zip(entry.top_logprobs, best.values, strict=True))
        if not _whole_characters(bytes(entry.bytes)):
            assert entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes)
        ids.append(chosen)
    assert len(content) == 12


def test_max_tokens_0_with_echo_scores_the_prompt_alone(byte_server: Server) -> None:
    """What evaluation harnesses send to score a prompt: its logprobs, no generated token."""
    client = byte_server.openai()
    result = client.completions.create(
        model=byte_server.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0.0
    )
    (choice,) = result.choices
    _, tokenizer = _hf(byte_server.config.model.source)
    prompt_ids = tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert result.usage.completion_tokens == 0 and result.usage.prompt_tokens == len(prompt_ids)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) and logprobs.token_logprobs[0] is None
    assert b"".join(bytes_of(t) for t in logprobs.tokens) == PROMPT.encode()
    reference = hf_log_softmax(byte_server, prompt_ids)
    expected = [float(reference[i - 1, prompt_ids[i]]) for i in range(1, len(prompt_ids))]
    assert all(abs(a - b) < ATOL for a, b in zip(logprobs.token_logprobs[1:], expected, strict=True))
    refused = byte_server.post("/v1/completions", json={"model": byte_server.model, "prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
