"""Request ids through Ray Serve's HTTP proxy, as a single vivace server gives them.

Serve's proxy gives every request that comes without an ``X-Request-Id`` a UUID of its own:
in the request's headers, where the ingress would take it for the client's (bodies' ids would
lose their ``chatcmpl-``, ``resp_``... form), and appended to the response's headers, beside
vivace's own. :class:`MarkServeRequestIds` wraps Serve's middleware in the proxy (a local
cluster's proxy loads :func:`middlewares` through ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``):
it marks the requests that came without an id and keeps a response's first ``X-Request-Id``
only; :class:`DropServeRequestIds`, in the ingress, drops the id of a marked request."""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.types import Message, Receive, Scope, Send

from vivace.server.asgi import HTTPMiddleware

CALLBACK = "vivace.cluster.proxy:middlewares"
_REQUEST_ID = b"x-request-id"
_SERVE_MADE = b"x-vivace-serve-made-request-id"  # the proxy's mark: the id is Serve's, not the client's


def middlewares() -> list[Middleware]:
    """The proxy callback: the middlewares Serve's proxy wraps around its own."""
    return [Middleware(MarkServeRequestIds)]


class MarkServeRequestIds(HTTPMiddleware):
    """In the proxy, outside Serve's request-id middleware (see the module docstring)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != _SERVE_MADE]
        if not any(k.lower() == _REQUEST_ID for k, _ in headers):
            headers.append((_SERVE_MADE, b"1"))
        scope["headers"] = headers

        async def send_first_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent = list(message.get("headers", []))
                ids = [i for i, (k, _) in enumerate(sent) if k.lower() == _REQUEST_ID]
                message["headers"] = [h for i, h in enumerate(sent) if i not in ids[1:]]
            await send(message)

        await self.app(scope, receive, send_first_id)


class DropServeRequestIds(HTTPMiddleware):
    """In the ingress, before vivace's request ids: a request the proxy marked came without an
    ``X-Request-Id`` (the one it has is Serve's)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope["headers"]
        if any(k == _SERVE_MADE for k, _ in headers):
            scope["headers"] = [(k, v) for k, v in headers if k not in (_SERVE_MADE, _REQUEST_ID)]
        await self.app(scope, receive, send)
