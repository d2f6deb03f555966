"""OpenAI-shaped error bodies and the exception handlers that make every failure one.

Contract: a client's mistake is a 4xx with ``{"error": {"message", "type", "param", "code"}}``;
only a fault of the server itself is a 500.
"""

from __future__ import annotations

import logging

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
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, the answer to every failed request."""

    error: ErrorDetail


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

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError | RequestValidationError)
    return from_validation_error(exc).response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":  # no such route: say which, as OpenAI does
        message = f"Invalid URL ({request.method} {request.url.path})"
    return APIError(exc.status_code, message, headers=exc.headers).response()


async def _server_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error", exc_info=exc)
    return APIError(500, "Internal server error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type the app can raise to an OpenAI error body."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
