"""The API's OpenAPI document, with each request body typed by the pydantic model the edge
validates it with (``serving.protocol``), as vLLM's server publishes its own.

The routes read their bodies themselves (``serving.api._parse``: a malformed body is an
OpenAI-shaped 400, not FastAPI's 422), so FastAPI cannot see the bodies' types; ``REQUEST_BODIES``
names them per route and ``openapi_document`` writes them into FastAPI's document, the models'
JSON schemas (validation mode: what a request may send) under ``components.schemas``. The
models' own validators check more than their JSON schemas say (a prompt's token ids against the
vocabulary, one structured-output field per request): a body the schema allows can still be a
400, never a 5xx.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    PinRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

REF_TEMPLATE = "#/components/schemas/{model}"
#: (path, method) -> the models a body may be (more than one: any of them, told apart by fields)
REQUEST_BODIES: Mapping[tuple[str, str], Sequence[type[BaseModel]]] = {
    ("/v1/completions", "post"): (CompletionRequest,),
    ("/v1/chat/completions", "post"): (ChatCompletionRequest,),
    ("/v1/pins", "post"): (PinRequest,),
    ("/tokenize", "post"): (TokenizeCompletionRequest, TokenizeChatRequest),
    ("/detokenize", "post"): (DetokenizeRequest,),
}
ERROR_RESPONSES = {
    "400": {"description": "a field or value refused (OpenAI's error object, naming the field in `param`)"},
    "401": {"description": "the API key is missing or wrong (when one is configured)"},
}


def openapi_document(app: FastAPI, description: str) -> dict[str, Any]:
    """``app``'s OpenAPI document with the request bodies of ``REQUEST_BODIES``; KeyError if a
    listed route is not one of ``app``'s."""
    document = get_openapi(title=app.title, version=app.version, description=description, routes=app.routes)
    models = sorted({m for ms in REQUEST_BODIES.values() for m in ms}, key=lambda m: m.__name__)
    refs, definitions = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    document.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
    for (path, method), bodies in REQUEST_BODIES.items():
        operation = document["paths"][path][method]
        options = [refs[(m, "validation")] for m in bodies]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        operation.setdefault("responses", {}).update(ERROR_RESPONSES)
    return document
