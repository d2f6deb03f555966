"""The FastAPI app factory: one app per engine, its state on ``app.state.vivace``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI
from starlette.requests import Request

from vivace.server.auth import check_api_key
from vivace.server.body_limit import BodyLimitMiddleware
from vivace.server.chat import create_chat_completion
from vivace.server.completions import create_completion
from vivace.server.errors import install_error_handlers
from vivace.server.routes import health, list_models, metrics
from vivace.server.settings import ServerSettings
from vivace.server.state import ServerState, server_state

if TYPE_CHECKING:
    from vivace.engine.async_engine import AsyncEngine


def _require_api_key(request: Request) -> None:
    request.state.api_key = check_api_key(request, server_state(request).settings.api_keys)


def build_app(engine: AsyncEngine | None, settings: ServerSettings) -> FastAPI:
    """An OpenAI-compatible app serving ``engine``.

    With ``engine`` None the app starts not ready (``/health`` 503, requests 503) until
    ``app.state.vivace.attach_engine(engine)``. The caller owns the engine and shuts it down.
    """
    app = FastAPI(title="vivace", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.vivace = ServerState(settings=settings, engine=engine)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    authenticated = [Depends(_require_api_key)]
    app.add_api_route("/v1/models", list_models, methods=["GET"], dependencies=authenticated)
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"],
                      dependencies=authenticated)
    app.add_api_route("/v1/completions", create_completion, methods=["POST"],
                      dependencies=authenticated)
    return app
