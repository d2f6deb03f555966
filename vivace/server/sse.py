"""Server-sent events: ``data: {json}\\n\\n`` frames ending in ``data: [DONE]`` (OpenAI's chat and
completions), or named ``event: <type>`` frames (the Responses API's, Anthropic's Messages API's)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from vivace.engine.step_timing import TimingLog
from vivace.server.errors import APIError

logger = logging.getLogger("vivace.server")

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    """One event frame carrying ``payload`` as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


def sse_named(kind: str, data: dict[str, Any]) -> str:
    """One frame of the event named ``kind``, carrying ``data`` as JSON."""
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _openai_error(exc: APIError) -> str:
    return f"data: {exc.response().body.decode()}\n\n"


class _EventStream(StreamingResponse):
    """Closes its event generator when the response ends, however it ends, so that a
    generator left at a ``yield`` by a disconnect still runs its clean-up (the abort) now;
    then calls ``on_close``, even if the generator never started."""

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], None],
                 writes: TimingLog | None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close
        self.writes = writes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            start = time.perf_counter()
            await send(message)
            self.writes.record(start, time.perf_counter() - start)

        try:
            await super().__call__(scope, receive, send if self.writes is None else timed_send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.on_close()


async def _framed(events: AsyncGenerator[str, None], end: str, error_frame: Callable[[APIError], str]
                  ) -> AsyncGenerator[str, None]:
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except APIError as exc:  # headers are gone: the error travels as an event
        yield error_frame(exc)
    except Exception as exc:
        logger.exception("stream failed", exc_info=exc)
        yield error_frame(APIError(500, "Internal server error"))
    if end:
        yield end


def sse_response(events: AsyncGenerator[str, None], on_close: Callable[[], None] = lambda: None,
                 writes: TimingLog | None = None, end: str = SSE_DONE,
                 error_frame: Callable[[APIError], str] = _openai_error) -> StreamingResponse:
    """A streaming response of ``events``, ended by ``end`` (``[DONE]``; "" for none) even after an error,
    which ``error_frame`` writes (default: OpenAI's error body as a ``data:`` frame); ``on_close``
    runs once the response has ended, however it ended; each send (headers, every frame) is timed
    into ``writes`` when given."""
    return _EventStream(_framed(events, end, error_frame), on_close, writes)
