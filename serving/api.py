"""The HTTP API as a FastAPI application over a started ``Cluster``.

OpenAI's ``/v1/completions``, ``/v1/chat/completions`` (JSON or server-sent events) and
``/v1/models`` (and ``/v1/models/{id}``); vLLM's tokenizer endpoints ``/tokenize``,
``/detokenize`` and ``/tokenizer_info`` (``serving.tokenization``); the operator's ``/health``
(200 only while every worker is healthy) and ``/metrics`` (Prometheus text); kvfleet's own
``/v1/pins`` and ``/v1/stats``; ``/openapi.json`` (``serving.openapi``). When an API key is
configured every route but ``/health`` and ``/metrics`` needs it. ``build_api`` is what the Ray Serve ingress serves; it
needs no Ray Serve itself.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import MutableMapping
from typing import Any, TypeVar

import ray.exceptions
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from cluster.api import Cluster
from configs.schema import ServeConfig
from serving.completions import Admission, Generation
from serving.errors import (
    APIError,
    bad_request,
    check_api_key,
    install_error_handlers,
    leading_field,
    model_not_found,
)
from serving.metrics import CONTENT_TYPE, ServeMetrics
from serving.openapi import openapi_document
from serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    PinRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    describe,
)
from serving.tokenization import Tokenization

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

HEALTH_TIMEOUT_S = 5.0
STATS_TIMEOUT_S = 10.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: the routes outside /v1 that need the API key (as vLLM keys them); /health and /metrics stay open
KEYED_ROOT_ROUTES = frozenset({"/tokenize", "/detokenize", "/tokenizer_info", "/openapi.json"})
OPENAPI_DESCRIPTION = "OpenAI's completions and chat completions, vLLM's tokenizer endpoints, kvfleet's pins and stats."


def served_model_name(cluster: Cluster) -> str:
    return cluster.config.serve.served_model_name or cluster.config.model.source


def resolve_api_key(config: ServeConfig) -> str | None:
    """The API key: the environment variable ``config.api_key_env`` if set, else the config's."""
    from_env = os.environ.get(config.api_key_env, "").strip()
    return from_env or config.api_key


def build_api(cluster: Cluster) -> FastAPI:
    """A FastAPI application serving ``cluster`` (started, or attached) over HTTP."""
    config = cluster.config.serve
    api_key = resolve_api_key(config)
    model_name = served_model_name(cluster)
    metrics = ServeMetrics()
    generation = Generation(cluster, model_name, metrics, Admission(config.max_queued_requests, config.retry_after_s))
    tokenization = Tokenization(cluster, model_name)
    created = int(time.time())
    app = FastAPI(title="kvfleet", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    app.add_middleware(AuthAndCount, api_key=api_key, metrics=metrics)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        return await _answer(generation, generation.prepare_completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        return await _answer(generation, generation.prepare_chat(body))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        data = await _json_object(request)
        body: TokenizeCompletionRequest | TokenizeChatRequest = (
            _validated(data, TokenizeChatRequest) if "messages" in data else _validated(data, TokenizeCompletionRequest)
        )
        return tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return tokenization.detokenize(await _parse(request, DetokenizeRequest))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return tokenization.info()

    def card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvfleet",
            "root": cluster.config.model.source,
            "max_model_len": cluster.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise model_not_found(model_id, model_name)
        return card()

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = await cluster.ahealth(HEALTH_TIMEOUT_S)
        bad = {w: why for w, why in workers.items() if why != "ok"}
        if bad:
            message = "unhealthy workers: " + "; ".join(f"{w}: {why}" for w, why in bad.items())
            body = {
                "status": "unhealthy",
                "workers": workers,
                "error": {"message": message, "type": "service_unavailable", "param": None, "code": "worker_unhealthy"},
            }
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "workers": workers})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            stats = await cluster.astats(STATS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a worker that does not answer must not hide the request metrics
            log.warning("metrics: cluster stats unavailable (%s)", exc)
            stats = None
        return Response(metrics.exposition(stats), media_type=CONTENT_TYPE)

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return await cluster.astats(STATS_TIMEOUT_S)

    @app.post("/v1/pins")
    async def create_pin(request: Request) -> JSONResponse:
        body = await _parse(request, PinRequest)
        try:
            pin_id = await cluster.apin_prefix(body.prefix, body.replicas, body.ttl, tier=body.tier, wait=False)
        except ValueError as exc:
            raise bad_request(leading_field(str(exc)), str(exc)) from None
        record = next((p for p in await cluster.apins() if p["pin_id"] == pin_id), {"pin_id": pin_id})
        return JSONResponse(_pin_json(record), status_code=201)

    @app.get("/v1/pins")
    async def list_pins() -> dict[str, Any]:
        return {"object": "list", "data": [_pin_json(p) for p in await cluster.apins()]}

    @app.delete("/v1/pins/{pin_id}")
    async def delete_pin(pin_id: str) -> dict[str, Any]:
        if not pin_id.isdigit():
            raise bad_request("pin_id", f"pin_id: must be a non-negative integer (got {pin_id!r})")
        if not await cluster.aunpin(int(pin_id)):
            raise APIError(404, f"pin_id: no pin {pin_id}", param="pin_id", code="pin_not_found")
        return {"id": int(pin_id), "object": "pin", "deleted": True}

    document: list[dict[str, Any]] = []  # built on the first request, once

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        if not document:
            document.append(openapi_document(app, OPENAPI_DESCRIPTION))
        return JSONResponse(document[0])

    return app


async def _parse(request: Request, model: type[M]) -> M:
    return _validated(await _json_object(request), model)


async def _json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object; 400 naming ``body`` otherwise."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request("body", f"body: not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None
    if not isinstance(data, dict):
        raise bad_request("body", f"body: must be a JSON object (got {type(data).__name__})")
    return data


def _validated(data: dict[str, Any], model: type[M]) -> M:
    """``data`` as ``model``; 400 naming the first bad field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        param, message = describe(exc)
        raise bad_request(param, message) from None


async def _answer(generation: Generation, prepared: Any) -> Response:
    result = await generation.respond(prepared)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)


def _pin_json(record: dict[str, Any]) -> dict[str, Any]:
    """A pin as the API shows it (the router's clock-local ``expires_at`` left out)."""
    return {
        "id": record["pin_id"],
        "object": "pin",
        **{k: v for k, v in record.items() if k not in ("pin_id", "expires_at")},
    }


class AuthAndCount:
    """ASGI middleware: the API key check on ``/v1`` routes and the request counter by status.
    Plain ASGI (not Starlette's BaseHTTPMiddleware) so streamed responses and client
    disconnects pass through untouched."""

    def __init__(self, app: Any, api_key: str | None, metrics: ServeMetrics):
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = _route_path(scope)
        status = [500]

        async def send_and_note(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        async def receive_or_disconnect() -> MutableMapping[str, Any]:
            # Serve's proxy cancels its side of a request whose client went away; a receive
            # pending on the proxy then fails with the cancellation instead of returning the
            # disconnect, and the streamed response would end in a traceback, not an abort.
            try:
                message: MutableMapping[str, Any] = await receive()
            except ray.exceptions.TaskCancelledError:
                return {"type": "http.disconnect"}
            return message

        try:
            if path.startswith("/v1") or path in KEYED_ROOT_ROUTES:
                check_api_key(Request(scope), self.api_key)
        except APIError as exc:
            await exc.response()(scope, receive_or_disconnect, send_and_note)
        else:
            await self.app(scope, receive_or_disconnect, send_and_note)
        finally:
            self.metrics.requests.labels(_endpoint(path), str(status[0])).inc()


def _route_path(scope: dict[str, Any]) -> str:
    """The request's path within the application: ASGI's ``path`` holds the ``root_path`` an
    application is mounted at (Ray Serve's route prefix, ``/bytes``), which routes do not see."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _endpoint(path: str) -> str:
    """The route a path belongs to (bounded label values: pin ids are not labels)."""
    if path.startswith("/v1/pins/"):
        return "/v1/pins/{id}"
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    known = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/pins", "/v1/stats", "/health", "/metrics"}
    return path if path in known or path in KEYED_ROOT_ROUTES else "other"
