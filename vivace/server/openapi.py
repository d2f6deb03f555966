"""The published contract: ``/openapi.json`` (OpenAPI 3.1) and ``/docs``, generated from the same
pydantic models that validate requests and shape responses, with every status the server sends.

The handlers parse their bodies themselves (for OpenAI's 400s and 415s), so each route declares
its body and responses here; the served model's own limits (context length, vocabulary) are
filled in once it is loaded."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import vivace
from vivace.server.anthropic_protocol import MessagesPrompt, MessagesRequest
from vivace.server.errors import ErrorResponse
from vivace.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest)
from vivace.server.request_id import HEADER, MAX_LENGTH, PATTERN
from vivace.server.responses_protocol import ResponsesRequest
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
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest, CompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest,
    ResponsesRequest, MessagesRequest, MessagesPrompt)
# One server-sent event of a streamed answer (OpenAPI 3.1 gives an event stream's media type
# the schema of each event, as tools like schemathesis read it): ``data`` is a chunk, as JSON,
# or ``[DONE]`` at the end; an error ends the stream as an error body, then ``[DONE]``.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "A JSON chunk of the answer, an error body, or [DONE]"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def error_responses(*statuses: int, body: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries: the error ``body`` (OpenAI's) for each of ``statuses``."""
    return {status: {"model": body, "description": _ERRORS[status]} for status in statuses}


def schema_ref(model: type[BaseModel]) -> dict[str, str]:
    """A reference to ``model``'s schema (every model of REQUEST_MODELS is in the document)."""
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def json_route(body: dict[str, Any], response_model: type[BaseModel],
               error_body: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    """``add_api_route`` keywords documenting a POST of a JSON body (``body``: its schema) answered
    by one JSON body, and its error statuses (with ``error_body``)."""
    ok = {"model": response_model, "description": "The answer"}
    return {"openapi_extra": {"requestBody": _json_body(body)},
            "responses": {200: ok, **error_responses(400, 401, 404, 405, 413, 415, 503, body=error_body)}}


def generation_route(request_model: type[BaseModel], response_model: type[BaseModel],
                     done: bool = True, error_body: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    """``add_api_route`` keywords documenting a generation endpoint: its JSON body, the whole or
    streamed (SSE) answer (ended by ``data: [DONE]`` if ``done``), the X-Request-Id header, and
    its error statuses (with ``error_body``)."""
    body = _json_body(schema_ref(request_model))
    header = {"name": HEADER, "in": "header", "required": False,
              "description": "The request's id; echoed in the response header and body",
              "schema": {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH, "pattern": PATTERN}}
    ok = {"model": response_model, "description": "The answer; with \"stream\": true, server-sent "
          "events of its chunks" + (", ended by data: [DONE]" if done else ""),
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}}
    return {"openapi_extra": {"requestBody": body, "parameters": [header]},
            "responses": {200: ok, **error_responses(400, 401, 404, 405, 413, 415, 429, 500, 503, 504,
                                                     body=error_body)}}


def _limit(schema: dict[str, Any], key: str, value: int) -> None:
    """Give every integer under ``schema`` (itself, its ``anyOf`` branches, its items) ``key``: ``value``."""
    if schema.get("type") == "integer":
        schema[key] = value
    for child in [*schema.get("anyOf", []), *([schema["items"]] if "items" in schema else [])]:
        _limit(child, key, value)


def decimal_below(n: int) -> str:
    """A regular expression of the decimal integers in ``[0, n)`` (``n >= 1``; no sign, no leading
    zero): a JSON object's keys have no ``maximum``, so a token-id key is bounded by its pattern."""
    digits = str(n)
    width = len(digits)
    branches = ["0"] + ([f"[1-9][0-9]{{0,{width - 2}}}"] if width > 1 else [])  # the shorter numbers
    for i, digit in enumerate(map(int, digits)):  # as long as n: n's first i digits, then a smaller one
        low = 1 if i == 0 else 0
        if digit > low:
            rest = f"[0-9]{{{width - i - 1}}}" if i < width - 1 else ""
            smaller = f"[{low}-{digit - 1}]" if digit - 1 > low else str(low)
            branches.append(f"{digits[:i]}{smaller}{rest}")
    return f"^({'|'.join(branches)})$"


def _served_limits(schemas: dict[str, Any], state: ServerState) -> None:
    engine = state.engine
    assert engine is not None
    vocab_size = len(engine.tokenizer)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = schemas[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in properties:
                _limit(properties[field], "maximum", engine.max_model_len - 1)
        _limit(properties["stop_token_ids"], "maximum", vocab_size - 1)
        bias = properties["logit_bias"]["anyOf"][0]
        (value,) = bias["patternProperties"].values()
        bias["patternProperties"] = {decimal_below(vocab_size): value}
    _limit(schemas["ResponsesRequest"]["properties"]["max_output_tokens"], "maximum", engine.max_model_len - 1)
    _limit(schemas["CompletionRequest"]["properties"]["prompt"], "maximum", vocab_size - 1)
    _limit(schemas["DetokenizeRequest"]["properties"]["tokens"], "maximum", vocab_size - 1)


def _apart_from(schemas: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The request models' ``defs``, those whose name a response model already holds in ``schemas``
    with another body (chat's ``ToolCall`` in and out, say) renamed ``<name>Param`` (as OpenAI's
    SDKs name their request types), with every reference to them: else one would replace the
    other in the document."""
    renamed = {name: f"{name}Param" for name, body in defs.items() if schemas.get(name, body) != body}
    if not renamed:
        return defs
    assert not set(renamed.values()) & (set(defs) | set(schemas)), renamed
    text = json.dumps(defs)
    for name, new in renamed.items():
        text = text.replace(f'"#/components/schemas/{name}"', f'"#/components/schemas/{new}"')
    return {renamed.get(name, name): body for name, body in json.loads(text).items()}


def install_openapi(app: FastAPI, state: ServerState) -> None:
    """Serve the generated document at ``/openapi.json`` (complete once the model is loaded)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title="vivace", version=vivace.__version__, routes=app.routes, openapi_version="3.1.0",
                             description="An OpenAI-compatible, latency-first LLM inference server.")
        _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                     ref_template="#/components/schemas/{model}")
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(_apart_from(schemas, defs["$defs"]))
        if state.settings.api_keys:
            schema["components"]["securitySchemes"] = {  # either one: OpenAI's clients send the first
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
            keyed = {route.path_format for route in app.routes if getattr(route, "dependencies", None)}
            for path, item in schema["paths"].items():
                if path in keyed:
                    for operation in item.values():
                        operation["security"] = [{"bearer": []}, {"apiKey": []}]
        if state.engine is not None:
            _served_limits(schemas, state)
            app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
