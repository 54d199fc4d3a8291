"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every
failure the API can answer: bad bodies (400), a missing or wrong API key (401), unknown routes
and models (404), a full queue (429 with ``Retry-After``), and anything unexpected (500, logged here, never a
traceback in the body)."""

from __future__ import annotations

import hmac
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An answer other than 2xx: status, message naming the field and value, and its param."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, served: str) -> APIError:
    """404 for a model this server does not serve (as OpenAI's and vLLM's: the client's NotFoundError)."""
    return APIError(
        404,
        f"model: the model {model!r} does not exist (this server serves {served!r})",
        param="model",
        code="model_not_found",
    )


def leading_field(message: str) -> str:
    """The field a message starts with: ``replicas`` of "replicas=3 but ..." or "replicas: ..."."""
    match = re.match(r"[A-Za-z_][A-Za-z0-9_.]*", message)
    return match.group(0) if match else "body"


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raise 401 unless ``Authorization: Bearer <api_key>`` (compared in constant time)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    if not hmac.compare_digest(given, api_key.encode()):
        raise APIError(
            401,
            "missing API key (send Authorization: Bearer <key>)" if not header else "invalid API key",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            error_body(exc.status_code, message), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query")) or None
        return JSONResponse(error_body(400, f"{param}: {first.get('msg')}", param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
