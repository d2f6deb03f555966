"""Request ids through the whole path: an incoming ``X-Request-Id`` (or one the handler makes)
is the id of the response body, the ``X-Request-Id`` response header, and part of every log line
written while the request is handled."""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vivace.server.asgi import HTTPMiddleware
from vivace.server.errors import APIError

HEADER = "X-Request-Id"
MAX_LENGTH = 128
PATTERN = r"^[A-Za-z0-9._:/+=-]+$"  # what a log line and a header can carry as they are
_VALID = re.compile(PATTERN)
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def request_id_of(request: Request, prefix: str) -> str:
    """This request's id: the client's ``X-Request-Id`` if it sent one, else ``<prefix><hex>``;
    from now on also the response header's."""
    request_id = request.state.request_id or f"{prefix}{uuid.uuid4().hex}"
    request.state.request_id = request_id
    current_request_id.set(request_id)
    return request_id


class RequestIdMiddleware(HTTPMiddleware):
    """Checks an incoming ``X-Request-Id`` (400 if it is longer than MAX_LENGTH or holds other
    characters than PATTERN's) and puts the request's id on its response."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope["headers"]).get(HEADER.lower().encode())
        state = scope.setdefault("state", {})
        state["request_id"] = given.decode("latin-1") if given is not None else None
        if given is not None and not (len(given) <= MAX_LENGTH and _VALID.match(state["request_id"])):
            state["request_id"] = None
            error = APIError(400, f"{HEADER} must be 1 to {MAX_LENGTH} characters of "
                                  "letters, digits and ._:/+=-", param=HEADER, code="invalid_value")
            await self._send_with_id(error.response(scope["path"]), scope, receive, send)
            return
        token = current_request_id.set(state["request_id"] or "-")
        try:
            await self.app(scope, receive, self._with_id(scope, send))
        finally:
            current_request_id.reset(token)

    @staticmethod
    def _with_id(scope: Scope, send: Send) -> Send:
        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                state = scope["state"]
                state["request_id"] = state.get("request_id") or uuid.uuid4().hex
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message["headers"] = [*headers, (b"x-request-id", state["request_id"].encode())]
            await send(message)
        return send_with_id

    async def _send_with_id(self, response: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        await response(scope, receive, self._with_id(scope, send))


class RequestIdLogFilter(logging.Filter):
    """Gives every log record a ``request_id`` attribute ("-" outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        return True
