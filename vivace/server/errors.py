"""OpenAI-shaped error bodies and the exception handlers that make every failure one.

Contract: a client's mistake is a 4xx with ``{"error": {"message", "type", "param", "code"}}``;
only a fault of the server itself is a 500. The routes of Anthropic's Messages API (``/v1/messages``
and the paths under it) answer the same errors in Anthropic's shape instead,
``{"type": "error", "error": {"type", "message"}}``, with the same statuses.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("vivace.server")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}
# Anthropic's error types. Overload keeps its 503 (Retry-After), which the anthropic client retries as
# it retries Anthropic's own 529; proxies and load balancers know 503 and not 529.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_PATH = "/v1/messages"
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, the answer to every failed request (but the Messages API's)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, the answer to every failed request of the Messages API."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def speaks_anthropic(path: str) -> bool:
    """Whether the route at ``path`` answers errors in Anthropic's shape (the Messages API's)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI error body (and a Retry-After header
    when ``retry_after`` seconds are given, plus any other ``headers``, e.g. a 405's Allow)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic's body, which has no ``param``: the message names the field instead."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        message = self.message if self.param is None or self.param in self.message else f"{self.param}: {self.message}"
        return AnthropicErrorResponse(error=AnthropicErrorDetail(type=kind, message=message)).model_dump()

    def response(self, path: str = "") -> JSONResponse:
        """The error as an HTTP response of the route at ``path``: in Anthropic's shape on the
        Messages API's routes, OpenAI's elsewhere."""
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        body = self.anthropic_body() if speaks_anthropic(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming an offending field, e.g. ``param="messages.0.role"``. Of a union's
    failures the deepest is the informative one ("content.0.type", not "content: not a str"),
    and of equally deep ones a broken bound ("prompt.0: >= 0") over another member's type."""
    first = max(exc.errors(), key=lambda error: (len(error.get("loc", ())),
                                                 not str(error.get("type", "")).endswith("_type")))
    # Unions add the member type to the location ("prompt.list[int].0"); keep the field path only.
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(part for part in loc if "[" not in part and part not in _UNION_TAGS
                     and not part.startswith(("constrained-", "function-"))) or None
    kind = first.get("type")
    if kind == "extra_forbidden":
        message = f"Unsupported or unknown field '{param}'"
    else:
        message = f"{param or 'Request body'}: {first.get('msg')}"
    return APIError(400, message, param=param,
                    code="invalid_json" if kind == "json_invalid" else "invalid_value")


def renamed(exc: APIError, renames: Sequence[tuple[re.Pattern[str], str]]) -> APIError:
    """``exc`` naming its field as an endpoint that maps its fields onto chat's names it: each
    ``(pattern, replacement)`` of ``renames`` applied to its param, and the param in its message."""
    if exc.param is None:
        return exc
    param = exc.param
    for pattern, name in renames:
        param = pattern.sub(name, param)
    exc.message = exc.message.replace(exc.param, param)
    exc.param = param
    return exc


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response(request.url.path)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError | RequestValidationError)
    return from_validation_error(exc).response(request.url.path)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":  # no such route: say which, as OpenAI does
        message = f"Invalid URL ({request.method} {request.url.path})"
    headers = dict(exc.headers or {})
    if headers.get("Allow") == "GET":  # every GET route answers HEAD too (vivace.server.asgi.HeadAsGet)
        headers["Allow"] = "GET, HEAD"
    return APIError(exc.status_code, message, headers=headers).response(request.url.path)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error", exc_info=exc)
    return APIError(500, "Internal server error").response(request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type the app can raise to an error body (OpenAI's; Anthropic's on
    the Messages API's routes)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
