"""A scripted OpenAI-style streaming server on loopback, for testing the benchmark.

It speaks just enough HTTP/1.1 (one request per connection) and emits chunks at fixed
offsets from the moment it has read the request, recording when each chunk was really
written so that tests can tell the client's error from the server's own timing slip.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Script:
    """What the server does: first chunk `ttft_s` after the request, then one chunk
    every `itl_s`, `tokens` chunks in all; 400 for any body field in `reject_fields`;
    `status` other than 200 answers every completion request with that error."""

    ttft_s: float = 0.05
    itl_s: float = 0.02
    tokens: int = 5
    reject_fields: frozenset[str] = frozenset()
    status: int = 200
    send_usage: bool = True


@dataclass
class Served:
    """One request as the server saw it: its body, and when (perf_counter) it was read
    and when each content chunk was written."""

    body: dict[str, Any]
    received: float
    sent: list[float] = field(default_factory=list)


class ScriptedServer:
    """Start with `await server.start()`; `url` is its base URL; `served` lists requests."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.served: list[Served] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def stop(self) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, body = await _read_request(reader)
            if method == "GET" and path == "/v1/models":
                await _send_json(writer, 200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
            else:
                await self._complete(writer, path, body)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _complete(self, writer: asyncio.StreamWriter, path: str, body: dict[str, Any]) -> None:
        script = self.script
        rejected = script.reject_fields & body.keys()
        if rejected or script.status != 200:
            status = 400 if rejected else script.status
            await _send_json(writer, status, {"error": {"message": f"rejected {sorted(rejected)}", "code": status}})
            return
        served = Served(body, time.perf_counter())
        self.served.append(served)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._stream(writer, path.endswith("/chat/completions"), served)
        finally:
            self.in_flight -= 1

    async def _stream(self, writer: asyncio.StreamWriter, chat: bool, served: Served) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        if chat:
            await _event(writer, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        tokens = min(self.script.tokens, served.body.get("max_tokens", self.script.tokens))
        for index in range(tokens):
            due = served.received + self.script.ttft_s + index * self.script.itl_s
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            text = f" t{index}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            served.sent.append(time.perf_counter())
            await _event(writer, {"choices": [choice]})
        if self.script.send_usage and served.body.get("stream_options", {}).get("include_usage"):
            prompt = served.body.get("prompt") or json.dumps(served.body.get("messages"))
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": tokens}
            await _event(writer, {"choices": [], "usage": usage})
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, Any]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    request_line, *header_lines = head.split("\r\n")
    method, path, _ = request_line.split(" ", 2)
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines if line)}
    length = int(headers.get("content-length", 0))
    body = json.loads(await reader.readexactly(length)) if length else {}
    return method, path, body


async def _send_json(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + data)
    await writer.drain()


async def _event(writer: asyncio.StreamWriter, payload: dict[str, Any]) -> None:
    writer.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
    await writer.drain()
