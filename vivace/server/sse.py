"""Server-sent events: ``data: {json}\\n\\n`` frames ending in ``data: [DONE]``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from vivace.server.errors import APIError

logger = logging.getLogger("vivace.server")

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    """One event frame carrying ``payload`` as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


async def _framed(events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    except Exception as exc:  # headers are gone: the error travels as an event
        logger.exception("stream failed", exc_info=exc)
        error = exc if isinstance(exc, APIError) else APIError(500, "Internal server error")
        yield f"data: {error.response().body.decode()}\n\n"
    yield SSE_DONE


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """A streaming response of ``events``, ended by ``[DONE]`` even after an error."""
    return StreamingResponse(_framed(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
