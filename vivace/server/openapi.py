"""The published contract: ``/openapi.json`` (OpenAPI 3.1) and ``/docs``, generated from the same
pydantic models that validate requests and shape responses, with every status the server sends.

The handlers parse their bodies themselves (for OpenAI's 400s and 415s), so each route declares
its body and responses here; the served model's own limits (context length, vocabulary) are
filled in once it is loaded."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from vivace.server.errors import ErrorResponse
from vivace.server.protocol import ChatCompletionRequest, CompletionRequest
from vivace.server.request_id import HEADER, MAX_LENGTH, PATTERN
from vivace.server.state import ServerState

_ERRORS = {
    400: "Malformed JSON, a schema violation, or a request the model can't serve (e.g. past its context)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    405: "Method not allowed (the Allow header lists the allowed ones)",
    413: "Request body too large",
    415: "Content-Type is not JSON",
    429: "Past the API key's concurrency or rate limits",
    500: "This request failed in the engine (other requests go on)",
    503: "Not ready, overloaded, or waited too long to be scheduled (Retry-After)",
    504: "Ran past the request timeout",
}
REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest)
# One server-sent event of a streamed answer (OpenAPI 3.1 gives an event stream's media type
# the schema of each event, as tools like schemathesis read it): ``data`` is a chunk, as JSON,
# or ``[DONE]`` at the end; an error ends the stream as an error body, then ``[DONE]``.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "A JSON chunk of the answer, an error body, or [DONE]"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries: OpenAI's error body for each of ``statuses``."""
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}


def generation_route(request_model: type[BaseModel], response_model: type[BaseModel]) -> dict[str, Any]:
    """``add_api_route`` keywords documenting a generation endpoint: its JSON body, the whole or
    streamed (SSE) answer, the X-Request-Id header, and its error statuses."""
    body = {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{request_model.__name__}"}}}}
    header = {"name": HEADER, "in": "header", "required": False,
              "description": "The request's id; echoed in the response header and body",
              "schema": {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH, "pattern": PATTERN}}
    ok = {"model": response_model, "description": "The answer; with \"stream\": true, server-sent "
          "events of its chunks, ended by data: [DONE]",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}}
    return {"openapi_extra": {"requestBody": body, "parameters": [header]},
            "responses": {200: ok, **error_responses(400, 401, 404, 405, 413, 415, 429, 500, 503, 504)}}


def _limit(schema: dict[str, Any], key: str, value: int) -> None:
    """Give every integer under ``schema`` (itself, its ``anyOf`` branches, its items) ``key``: ``value``."""
    if schema.get("type") == "integer":
        schema[key] = value
    for child in [*schema.get("anyOf", []), *([schema["items"]] if "items" in schema else [])]:
        _limit(child, key, value)


def _served_limits(schemas: dict[str, Any], state: ServerState) -> None:
    engine = state.engine
    assert engine is not None
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = schemas[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in properties:
                _limit(properties[field], "maximum", engine.max_model_len - 1)
        _limit(properties["stop_token_ids"], "maximum", len(engine.tokenizer) - 1)
    _limit(schemas["CompletionRequest"]["properties"]["prompt"], "maximum", len(engine.tokenizer) - 1)


def install_openapi(app: FastAPI, state: ServerState) -> None:
    """Serve the generated document at ``/openapi.json`` (complete once the model is loaded)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title="vivace", version="0.1.0", routes=app.routes, openapi_version="3.1.0",
                             description="An OpenAI-compatible, latency-first LLM inference server.")
        _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                     ref_template="#/components/schemas/{model}")
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(defs["$defs"])
        if state.settings.api_keys:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, item in schema["paths"].items():
                if path.startswith("/v1/"):
                    for operation in item.values():
                        operation["security"] = [{"bearer": []}]
        if state.engine is not None:
            _served_limits(schemas, state)
            app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
