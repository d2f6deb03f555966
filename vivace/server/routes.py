"""The small endpoints: ``/health``, ``/v1/models`` and ``/metrics``."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vivace.server.errors import APIError
from vivace.server.metrics import CONTENT_TYPE
from vivace.server.state import server_state


async def health(request: Request) -> Response:
    """200 while the model is loaded, warmed up and its engine running; 503 otherwise."""
    engine = server_state(request).engine
    if engine is None:
        return APIError(503, "The model is still loading", code="not_ready").response()
    if not engine.is_running:
        return APIError(503, "The engine has stopped", code="engine_dead").response()
    return JSONResponse({"status": "ok"})


async def list_models(request: Request) -> Response:
    """The one served model, in OpenAI's list shape."""
    state = server_state(request)
    engine = state.engine_for(None)
    card = {"id": state.model_name(), "object": "model", "created": int(time.time()),
            "owned_by": "vivace", "max_model_len": engine.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


async def metrics(request: Request) -> Response:
    """Prometheus text exposition of this server's metrics."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)
