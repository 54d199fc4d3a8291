"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` in vLLM's shapes, behind the API key:
on the ``bytes`` application (a Hugging Face tokenizer with a BOS and a chat template) the ids
are the tokenizer's own and a chat's are the ones ``/v1/chat/completions`` runs; on ``main`` (the
byte vocabulary) each byte is its id."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.serve.byte_tokenizers import BOS, CHAT_TEMPLATE, EOS, UNK
from tests.serve.conftest import Server

TEXT = "the cat 😀 中文"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the mat?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(byte_server: Server):  # type: ignore[no-untyped-def]  # a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(byte_server.config.model.source)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_a_text_gives_the_tokenizers_ids_and_pieces(
    byte_server: Server, hf_tokenizer: object, add_special_tokens: bool
) -> None:
    body = {"model": byte_server.model, "prompt": TEXT, "add_special_tokens": add_special_tokens}
    answer = byte_server.post("/tokenize", json={**body, "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    expected = hf_tokenizer.encode(TEXT, add_special_tokens=add_special_tokens)  # type: ignore[attr-defined]
    context = byte_server.get(f"/v1/models/{byte_server.model}").json()["max_model_len"]
    assert answer.json() == {
        "count": len(expected),
        "max_model_len": context,
        "tokens": expected,
        "token_strs": hf_tokenizer.convert_ids_to_tokens(expected),  # type: ignore[attr-defined]
    }
    assert (expected[0] == 1) is add_special_tokens  # the BOS
    plain = byte_server.post("/tokenize", json={"prompt": TEXT}).json()  # vLLM's defaults: BOS, no strings
    assert plain["token_strs"] is None and plain["tokens"] == hf_tokenizer.encode(TEXT)  # type: ignore[attr-defined]


def test_tokenize_messages_gives_the_ids_a_chat_completion_runs(byte_server: Server) -> None:
    answer = byte_server.post("/tokenize", json={"model": byte_server.model, "messages": MESSAGES})
    assert answer.status_code == 200, answer.text
    ids = answer.json()["tokens"]
    chat = byte_server.openai().chat.completions.create(
        model=byte_server.model, messages=MESSAGES, max_tokens=1, temperature=0.0
    )
    assert chat.usage.prompt_tokens == len(ids) == answer.json()["count"]
    detokenized = byte_server.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert detokenized == "<system>be brief<user>the mat?<assistant>"  # CHAT_TEMPLATE, special tokens skipped
    without = byte_server.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["tokens"] == ids[: without["count"]] and without["count"] < len(ids)


def test_detokenize_gives_the_text(byte_server: Server, hf_tokenizer: object) -> None:
    ids = hf_tokenizer.encode(TEXT)  # type: ignore[attr-defined]
    answer = byte_server.post("/detokenize", json={"model": byte_server.model, "tokens": ids})
    assert answer.status_code == 200 and answer.json() == {"prompt": TEXT}
    assert byte_server.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_tokenizer_info_is_the_tokenizers_configuration(byte_server: Server, hf_tokenizer: object) -> None:
    answer = byte_server.get("/tokenizer_info")
    assert answer.status_code == 200, answer.text
    info = answer.json()
    assert info["tokenizer_class"] == type(hf_tokenizer).__name__  # transformers' class for tokenizer.json
    assert (info["bos_token"], info["eos_token"], info["unk_token"]) == (BOS, EOS, UNK)
    assert info["chat_template"] == CHAT_TEMPLATE
    assert info["vocab_size"] == len(_hf_vocabulary(byte_server)) and info["model_max_length"] > 0
    assert not any("/" in str(v) and Path(str(v)).exists() for v in info.values())  # no server paths


def test_the_byte_vocabulary_tokenizes_each_byte(server: Server) -> None:
    answer = server.post("/tokenize", json={"prompt": "é!", "return_token_strs": True}).json()
    assert answer["tokens"] == [0xC3, 0xA9, ord("!")] and answer["token_strs"] == ["bytes:\\xc3", "bytes:\\xa9", "!"]
    assert server.post("/detokenize", json={"tokens": [0xC3, 0xA9]}).json() == {"prompt": "é"}
    info = server.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "ByteTokenizer" and info["eos_token"] == "\x02"
    assert info["vocab_size"] == 256 and info["chat_template"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/tokenizer_info", None),
        ("GET", "/v1/models", None),  # under the application's route prefix (/bytes) too
    ],
)
def test_the_tokenizer_endpoints_need_the_api_key(byte_server: Server, method: str, path: str, body: object) -> None:
    answer = httpx.request(method, f"{byte_server.base}{path}", json=body, timeout=30)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/detokenize", {"tokens": [10**6]}, "tokens", "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0", ">= 0"),
        ("/detokenize", {"tokens": "abc"}, "tokens", "list"),
        ("/tokenize", {"prompt": 5}, "prompt", "string"),
        ("/tokenize", {"prompt": "x", "extra": 1}, "extra", "unknown field"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template", "not supported"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message", "supported"),
        ("/tokenize", {"messages": []}, "messages", "empty"),
    ],
)
def test_bad_tokenizer_requests_are_400s_naming_the_field(
    byte_server: Server, path: str, body: dict[str, object], param: str, fragment: str
) -> None:
    answer = byte_server.post(path, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_another_model_is_a_404(byte_server: Server) -> None:
    answer = byte_server.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"


def _hf_vocabulary(server: Server) -> dict[str, int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.config.model.source).get_vocab()
