"""The base of vivace's ASGI middlewares, and the one that answers HEAD as GET."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HTTPMiddleware:
    """Passes every scope but HTTP (lifespan, websocket) straight to the app; an HTTP request
    goes to ``handle``, which calls ``self.app`` itself."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class HeadAsGet(HTTPMiddleware):
    """Answers ``HEAD`` as the app answers ``GET``, headers and all, without the body (HTTP's
    rule, which load balancers' and Kubernetes' probes of ``/health`` rely on)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)
