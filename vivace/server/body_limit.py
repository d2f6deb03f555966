"""ASGI middleware that caps request bodies: 413 by Content-Length, or while reading."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vivace.server.asgi import HTTPMiddleware
from vivace.server.errors import APIError


class BodyLimitMiddleware(HTTPMiddleware):
    """Reads each HTTP body in full before the app sees it (at most ``max_bytes``), then replays
    it; later ``receive`` calls reach the client's connection, so disconnects still show."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit():
            await self._reject(scope, send, APIError(400, "Invalid Content-Length header"))
            return
        if int(declared) > self.max_bytes:
            await self._reject(scope, send, self._too_large())
            return
        body = await self._read_body(receive)
        if body is None:
            await self._reject(scope, send, self._too_large())
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # disconnected; the app will see it on its next receive
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"Request body exceeds {self.max_bytes} bytes",
                        code="request_too_large")

    @staticmethod
    async def _reject(scope: Scope, send: Send, error: APIError) -> None:
        async def no_body() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}
        await error.response(scope["path"])(scope, no_body, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
