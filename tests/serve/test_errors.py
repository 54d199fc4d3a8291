"""Bad requests get OpenAI-shaped errors that name the field and value, with the right status,
and the server keeps serving: 400 for every bad body, 401 without the key on /v1 routes, 404 for
unknown routes, models and pins, never a traceback in a body."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest

from tests.serve.conftest import Server

OK_COMPLETION = {"prompt": "hello", "max_tokens": 2}
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (route, body fields over the good body, the param the error must name, a fragment of its message)
BAD_BODIES: list[tuple[str, dict[str, Any], str, str]] = [
    ("completions", {"temperature": math.nan}, "temperature", "finite"),
    ("completions", {"temperature": math.inf}, "temperature", "finite"),
    ("completions", {"temperature": -0.5}, "temperature", ">= 0"),
    ("completions", {"temperature": 3}, "temperature", "<= 2"),
    ("completions", {"temperature": "abc"}, "temperature", "'abc'"),
    ("completions", {"top_p": 0}, "top_p", "> 0"),
    ("completions", {"top_p": math.nan}, "top_p", "finite"),
    ("completions", {"top_k": -2}, "top_k", ">= -1"),
    ("completions", {"top_k": 2.5}, "top_k", "integer"),
    ("completions", {"max_tokens": "5"}, "max_tokens", "'5'"),
    ("completions", {"max_tokens": 0}, "max_tokens", ">= 1"),
    ("completions", {"max_tokens": 5.0}, "max_tokens", "integer"),
    ("completions", {"max_tokens": True}, "max_tokens", "integer"),
    ("completions", {"max_tokens": 100_000}, "max_tokens", "context"),
    ("completions", {"seed": "x"}, "seed", "integer"),
    ("completions", {"seed": 2**70}, "seed", "64 bits"),
    ("completions", {"stop": [""]}, "stop", "non-empty"),
    ("completions", {"stop": 5}, "stop", "5"),
    ("completions", {"stream": "yes"}, "stream", "true or false"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ("completions", {"prompt": None}, "prompt", "null"),
    ("completions", {"prompt": ""}, "prompt", "empty"),
    ("completions", {"prompt": []}, "prompt", "empty"),
    ("completions", {"prompt": [1, 2, -3]}, "prompt", "-3"),
    ("completions", {"prompt": [1, 2, 999_999]}, "prompt", "999999"),
    ("completions", {"prompt": "x" * 600}, "prompt", "context"),
    ("completions", {"prompt": 42}, "prompt", "42"),
    ("completions", {"model": 7}, "model", "string"),
    ("completions", {"n": 0}, "n", ">= 1"),
    ("completions", {"logprobs": 21}, "logprobs", "<= 20"),
    ("completions", {"echo": "yes"}, "echo", "true or false"),
    ("completions", {"best_of": 1, "n": 2}, "best_of", ">= n"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty", "<= 2"),
    ("completions", {"logit_bias": {"300": 1}}, "logit_bias", "vocabulary"),
    ("completions", {"suffix": "tail"}, "suffix", "not supported"),
    ("completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured-output"),
    ("completions", {"no_such_field": 1}, "no_such_field", "unknown field"),
    ("chat/completions", {"messages": []}, "messages", "empty"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "robot"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content", "missing"),
    ("chat/completions", {"messages": "hi"}, "messages", "list"),
    ("chat/completions", {"temperature": math.inf}, "temperature", "finite"),
    ("chat/completions", {"n": 129}, "n", "<= 128"),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs", "logprobs=true"),
    ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
    ("chat/completions", {"tools": [{"type": "function"}]}, "tools.0.function", "missing"),
    ("chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens", ">= 1"),
]


def _body(server: Server, route: str, fields: dict[str, Any]) -> dict[str, Any]:
    base = OK_CHAT if route.startswith("chat") else OK_COMPLETION
    return {"model": server.model, **base, **fields}


@pytest.mark.parametrize(
    ("route", "fields", "param", "fragment"),
    BAD_BODIES,
    ids=[f"{r}-{p}-{i}" for i, (r, _, p, _) in enumerate(BAD_BODIES)],
)
def test_a_bad_body_is_a_400_naming_its_field(
    server: Server, route: str, fields: dict[str, Any], param: str, fragment: str
) -> None:
    content = json.dumps(_body(server, route, fields))  # json.dumps writes NaN / Infinity as Python does
    response = server.post(f"/v1/{route}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"].startswith(f"{param}:") or error["message"].startswith("prompt:"), error["message"]
    assert fragment in error["message"], error["message"]
    assert "Traceback" not in response.text


def test_the_openai_client_sees_the_400_with_its_param(server: Server) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=server.model, prompt="x", temperature="abc")  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "temperature"  # type: ignore[index]
    assert "'abc'" in caught.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_a_400(server: Server, content: bytes) -> None:
    response = server.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "body"


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic abc", "Bearer"])
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/pins"),
        ("POST", "/v1/pins"),
        ("DELETE", "/v1/pins/1"),
        ("GET", "/v1/stats"),
    ],
)
def test_401_without_the_right_key_admin_endpoints_included(
    server: Server, header: str | None, method: str, path: str
) -> None:
    headers = {"Authorization": header} if header is not None else {}
    response = httpx.request(method, f"{server.base}{path}", headers=headers, json={}, timeout=30)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "authentication_error"


def test_the_openai_client_with_a_wrong_key_gets_401(server: Server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=server.model, prompt="x", max_tokens=1)


def test_the_key_guards_v1_routes_while_health_and_metrics_stay_open(server: Server) -> None:
    """As vLLM's: probes and Prometheus scrapers need no key; every /v1 route does."""
    assert server.api_key is not None
    assert httpx.get(f"{server.base}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{server.base}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.base}/metrics", timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_a_404_the_client_raises_as_not_found(server: Server, stream: bool) -> None:
    client = server.openai()
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1, stream=stream)
    assert caught.value.body == {
        "message": f"model: the model 'gpt-4' does not exist (this server serves {server.model!r})",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="no/such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1, stream=stream
        )
    assert caught.value.body["param"] == "model"  # type: ignore[index]
    response = server.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_a_model_by_id_is_the_listed_card_and_another_id_is_a_404(server: Server) -> None:
    client = server.openai()
    card = client.models.retrieve(server.model)
    assert card.id == server.model and card.object == "model"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    for other in ("gpt-4", "org/" + server.model):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(other)
        assert caught.value.body["param"] == "model"  # type: ignore[index]
        assert repr(other) in caught.value.body["message"]  # type: ignore[index]


def test_unknown_routes_and_pins_are_404_in_openai_shape(server: Server) -> None:
    response = server.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    response = httpx.delete(f"{server.base}/v1/pins/987654", headers=server.headers(), timeout=30)
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "pin_id"
    response = httpx.delete(f"{server.base}/v1/pins/abc", headers=server.headers(), timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "pin_id"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prefix": ""}, "prefix"),
        ({"prefix": None}, "prefix"),
        ({"prefix": "abc", "replicas": 0}, "replicas"),
        ({"prefix": "abc", "replicas": 9}, "replicas"),
        ({"prefix": "abc", "ttl": math.nan}, "ttl"),
        ({"prefix": "abc", "ttl": -1}, "ttl"),
        ({"prefix": "abc", "ttl": "1"}, "ttl"),
        ({"prefix": "abc", "tier": "disk"}, "tier"),
        ({"prefix": "abc", "tier": "host"}, "tier"),
    ],
)
def test_bad_pins_are_400_naming_the_field(server: Server, fields: dict[str, Any], param: str) -> None:
    response = server.post("/v1/pins", content=json.dumps(fields), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_server_still_serves_after_the_bad_requests(server: Server) -> None:
    # greedy and ignore_eos: a sampled EOS (rare at temperature 1 on this random model) ends early
    result = server.openai().completions.create(
        model=server.model, prompt="fine", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.usage.completion_tokens == 3
    assert server.get("/health").json()["status"] == "ok"
