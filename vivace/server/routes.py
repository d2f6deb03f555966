"""The small endpoints: ``/health``, ``/version``, ``/v1/models`` (and one model's card),
``/metrics`` and ``/debug/timings``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import vivace
from vivace.server.errors import APIError
from vivace.server.metrics import CONTENT_TYPE
from vivace.server.state import server_state

if TYPE_CHECKING:
    from vivace.engine.async_engine import AsyncEngine


async def health(request: Request) -> Response:
    """200 while the server can serve (model loaded, warmed up, engine running); 503 otherwise."""
    problem = server_state(request).unavailable()
    return problem.response() if problem is not None else JSONResponse({"status": "ok"})


async def version(request: Request) -> Response:
    """vivace's version, as vLLM's ``/version`` gives its own."""
    return JSONResponse({"version": vivace.__version__})


def _card(name: str, engine: AsyncEngine) -> dict[str, object]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "vivace",
            "max_model_len": engine.max_model_len}


async def list_models(request: Request) -> Response:
    """The served models, in OpenAI's list shape."""
    cards = [_card(name, engine) for name, engine in server_state(request).served_models()]
    return JSONResponse({"object": "list", "data": cards})


async def retrieve_model(request: Request, model: str) -> Response:
    """One served model's card; 404 ``model_not_found`` for a name this server doesn't serve."""
    return JSONResponse(_card(model, server_state(request).engine_for(model)))


async def metrics(request: Request) -> Response:
    """Prometheus text exposition of this server's metrics."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def debug_timings(request: Request) -> Response:
    """The recent timing events (``vivace.engine.step_timing``) that started at or after the
    ``since`` query parameter (``time.perf_counter()`` seconds, default all), by kind, with the
    server's ``now`` on the same clock. 503 while the model loads; 400 for a bad ``since``;
    404 behind the Ray Serve ingress (the replicas' step timings are in /metrics)."""
    state = server_state(request)
    timings = state.engine_timings()
    try:
        since = float(request.query_params.get("since", "-inf"))
    except ValueError:
        raise APIError(400, "since must be a number of seconds", param="since") from None
    logs = {"steps": timings.steps, "handoffs": timings.handoffs, "gc": timings.gc,
            **state.metrics.work}
    return JSONResponse({"now": time.perf_counter(), **{kind: log.rows(since) for kind, log in logs.items()}})
