"""``/openapi.json``: every route, the request bodies typed by the models the edge validates
with, behind the API key; and a bounded schemathesis fuzz of the ``main`` application from that
document that gets no 5xx."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest

from serving.openapi import REQUEST_BODIES
from tests.serve.conftest import Server

ROUTES = {
    ("/v1/completions", "post"),
    ("/v1/chat/completions", "post"),
    ("/v1/models", "get"),
    ("/v1/models/{model_id}", "get"),
    ("/tokenize", "post"),
    ("/detokenize", "post"),
    ("/tokenizer_info", "get"),
    ("/health", "get"),
    ("/metrics", "get"),
    ("/v1/stats", "get"),
    ("/v1/pins", "post"),
    ("/v1/pins", "get"),
    ("/v1/pins/{pin_id}", "delete"),
}
#: draws per operation: the fuzz costs a few seconds (13 operations, at most 4 tokens a sample)
EXAMPLES = 4
#: the fuzz's bounds on the fields that set a request's work (the document's copy is narrowed)
WORK_BOUNDS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "best_of": 2, "replicas": 1, "ttl": 5}


@pytest.fixture(scope="module")
def document(server: Server) -> dict[str, Any]:
    answer = server.get("/openapi.json")
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_document_lists_every_route_with_typed_bodies(document: dict[str, Any]) -> None:
    listed = {(path, method) for path, operations in document["paths"].items() for method in operations}
    assert listed == ROUTES
    components = document["components"]["schemas"]
    for (path, method), models in REQUEST_BODIES.items():
        schema = document["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        refs = [option["$ref"] for option in schema.get("anyOf", [schema])]
        assert refs == [f"#/components/schemas/{m.__name__}" for m in models]
        for model in models:
            assert set(components[model.__name__]["properties"]) == set(model.model_fields), model
    completion = components["CompletionRequest"]
    assert completion["required"] == ["model", "prompt"] and completion["additionalProperties"] is False
    assert {"type": "string", "minLength": 1} in completion["properties"]["prompt"]["anyOf"]
    assert completion["properties"]["n"]["maximum"] == 128
    messages = components["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["items"] == {"$ref": "#/components/schemas/ChatMessage"}


def test_the_document_needs_the_api_key(server: Server) -> None:
    answer = httpx.get(f"{server.base}/openapi.json", timeout=30)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"


def test_a_fuzz_of_the_document_gets_no_server_error(server: Server, document: dict[str, Any]) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_dict(_bounded(document))
    pins_before = {p["id"] for p in server.get("/v1/pins").json()["data"]}
    calls: list[tuple[str, int]] = []
    try:
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy())
            def call(case: Any) -> None:
                response = case.call(base_url=server.base, headers=server.headers(), timeout=60)
                calls.append((case.operation.label, response.status_code))
                assert response.status_code < 500, f"{case.operation.label}: {response.status_code} {response.text}"

            call()
    finally:
        for pin in server.get("/v1/pins").json()["data"]:
            if pin["id"] not in pins_before:
                httpx.delete(f"{server.base}/v1/pins/{pin['id']}", headers=server.headers(), timeout=60)
    assert {label for label, _ in calls} == {f"{m.upper()} {p}" for p, m in ROUTES}
    assert any(status == 200 for _, status in calls)  # some draws were served, not all refused


def _bounded(document: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``document`` whose request bodies ask for little work (``WORK_BOUNDS``)."""
    out = copy.deepcopy(document)
    for component in out["components"]["schemas"].values():
        for name, bound in WORK_BOUNDS.items():
            if name in component.get("properties", {}):
                component["properties"][name] = _capped(component["properties"][name], bound)
    return out


def _capped(schema: dict[str, Any], bound: int) -> dict[str, Any]:
    if "anyOf" in schema:
        return {**schema, "anyOf": [_capped(option, bound) for option in schema["anyOf"]]}
    if schema.get("type") in ("integer", "number"):
        return {**schema, "maximum": bound}
    return schema
