"""The FastAPI app factory: one app per engine, its state on ``app.state.vivace``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.requests import Request

from vivace.server.anthropic_api import count_message_tokens, create_message
from vivace.server.anthropic_objects import Message, TokenCount
from vivace.server.anthropic_protocol import MessagesPrompt, MessagesRequest
from vivace.server.asgi import HeadAsGet
from vivace.server.auth import check_api_key
from vivace.server.body_limit import BodyLimitMiddleware
from vivace.server.chat import create_chat_completion
from vivace.server.completions import create_completion
from vivace.server.errors import AnthropicErrorResponse, install_error_handlers
from vivace.server.openapi import error_responses, generation_route, install_openapi, json_route, schema_ref
from vivace.server.playground import mount_playground
from vivace.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest)
from vivace.server.request_id import RequestIdMiddleware
from vivace.server.responses_api import create_response
from vivace.server.responses_objects import ResponseObject
from vivace.server.responses_protocol import ResponsesRequest
from vivace.server.responses import (
    ChatCompletionResponse, CompletionResponse, DetokenizeResponse, HealthResponse, ModelCard, ModelList,
    TokenizeResponse, VersionResponse)
from vivace.server.routes import debug_timings, health, list_models, metrics, retrieve_model, version
from vivace.server.settings import ServerSettings
from vivace.server.state import ServerState, server_state
from vivace.server.tokens import detokenize, tokenize

if TYPE_CHECKING:
    from vivace.engine.async_engine import AsyncEngine


def require_api_key(request: Request) -> None:
    """A route dependency: 401 unless the request carries one of the server's keys (if it has any)."""
    request.state.api_key = check_api_key(request, server_state(request).settings.api_keys)


def build_app(engine: AsyncEngine | None, settings: ServerSettings,
              state: ServerState | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``engine``.

    With ``engine`` None the app starts not ready (``/health`` 503, requests 503) until
    ``app.state.vivace.attach_engine(engine)``. The caller owns the engine and shuts it down.
    ``state`` replaces the app's ServerState (a scaled-out server passes its own, whose
    engines are remote, built with the same ``settings``); ``engine`` is then ignored.
    """
    app = FastAPI(title="vivace", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.vivace = state or ServerState(settings=settings, engine=engine)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(HeadAsGet)
    if settings.allowed_origins:  # outermost: a browser's preflight is answered before the rest
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           # a page's client reads when to retry a 429 or 503 as any other does
                           expose_headers=["X-Request-Id", "Retry-After"])
    app.add_api_route("/health", health, methods=["GET"], response_model=HealthResponse,
                      responses=error_responses(405, 503))
    app.add_api_route("/version", version, methods=["GET"], response_model=VersionResponse,
                      responses=error_responses(405))
    app.add_api_route("/metrics", metrics, methods=["GET"], responses={
        200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **error_responses(405)})
    authenticated = [Depends(require_api_key)]
    app.add_api_route("/v1/models", list_models, methods=["GET"], dependencies=authenticated,
                      response_model=ModelList, responses=error_responses(401, 405, 503))
    app.add_api_route("/v1/models/{model:path}", retrieve_model, methods=["GET"], dependencies=authenticated,
                      response_model=ModelCard, responses=error_responses(401, 404, 405, 503))
    app.add_api_route("/debug/timings", debug_timings, methods=["GET"], dependencies=authenticated,
                      responses=error_responses(400, 401, 405, 503))
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"],
                      dependencies=authenticated,
                      **generation_route(ChatCompletionRequest, ChatCompletionResponse))
    app.add_api_route("/v1/completions", create_completion, methods=["POST"],
                      dependencies=authenticated, **generation_route(CompletionRequest, CompletionResponse))
    app.add_api_route("/v1/responses", create_response, methods=["POST"], dependencies=authenticated,
                      **generation_route(ResponsesRequest, ResponseObject, done=False))
    app.add_api_route("/v1/messages", create_message, methods=["POST"], dependencies=authenticated,
                      **generation_route(MessagesRequest, Message, done=False, error_body=AnthropicErrorResponse))
    app.add_api_route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"], dependencies=authenticated,
                      **json_route(schema_ref(MessagesPrompt), TokenCount, error_body=AnthropicErrorResponse))
    tokenize_body = {"oneOf": [schema_ref(TokenizeCompletionRequest), schema_ref(TokenizeChatRequest)]}
    app.add_api_route("/tokenize", tokenize, methods=["POST"], dependencies=authenticated,
                      **json_route(tokenize_body, TokenizeResponse))
    app.add_api_route("/detokenize", detokenize, methods=["POST"], dependencies=authenticated,
                      **json_route(schema_ref(DetokenizeRequest), DetokenizeResponse))
    _install_extras(app, settings)
    install_openapi(app, app.state.vivace)
    return app


def _install_extras(app: FastAPI, settings: ServerSettings) -> None:
    """The web playground at ``/`` and, when asked for, OpenTelemetry request traces."""
    if settings.ui:
        mount_playground(app)
    if settings.otlp_traces_endpoint:
        try:  # OpenTelemetry is imported only when traces are asked for
            from vivace.server.tracing import install_tracing
        except ImportError as exc:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: "
                             "pip install 'vivace[otel]'") from exc
        install_tracing(app, settings.otlp_traces_endpoint)
