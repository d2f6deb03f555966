"""From a request's structured-output fields to the engine's ``StructuredOutput``: OpenAI's
``response_format``, vLLM's ``structured_outputs`` / ``guided_*`` extras and llama.cpp server's
``grammar`` / ``json_schema``. At most one of
them may constrain a request; one that does not compile is a 400 naming its field, before
anything reaches the engine."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from vivace.engine.sampling_params import StructuredOutput
from vivace.server.errors import APIError
from vivace.server.protocol import SamplingRequest

if TYPE_CHECKING:
    from vivace.engine.async_engine import AsyncEngine

ANY_JSON_OBJECT = StructuredOutput("json_schema", '{"type": "object"}')


def json_schema(schema: dict[str, Any] | str, param: str) -> StructuredOutput:
    """A JSON-schema constraint (property order kept: it is the order the output follows)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"{param}: not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema must be an object", param=param)
    return StructuredOutput("json_schema", json.dumps(schema))


def _requested(body: SamplingRequest) -> list[tuple[str, StructuredOutput]]:
    found = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", ANY_JSON_OBJECT))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise APIError(400, "response_format.json_schema is required when type is json_schema",
                           param="response_format.json_schema")
        param = "response_format.json_schema.schema"
        found.append((param, json_schema(response_format.json_schema.schema_, param)))
    extras = body.structured_outputs
    prefix = "structured_outputs."
    candidates: list[tuple[str, Any, str]] = [
        ("guided_json", body.guided_json, "json_schema"), ("guided_regex", body.guided_regex, "regex"),
        ("guided_choice", body.guided_choice, "choice"), ("guided_grammar", body.guided_grammar, "grammar"),
        ("grammar", body.grammar, "grammar"), ("json_schema", body.json_schema, "json_schema")]
    if extras is not None:
        candidates += [(prefix + "json", extras.json_, "json_schema"), (prefix + "regex", extras.regex, "regex"),
                       (prefix + "choice", extras.choice, "choice"),
                       (prefix + "grammar", extras.grammar, "grammar")]
        if extras.json_object:
            found.append((prefix + "json_object", ANY_JSON_OBJECT))
    for param, value, kind in candidates:
        if value is None:
            continue
        if kind == "json_schema":
            found.append((param, json_schema(value, param)))
        else:
            found.append((param, StructuredOutput(kind, json.dumps(value) if kind == "choice" else value)))
    return found


def structured_output(body: SamplingRequest) -> tuple[str, StructuredOutput] | None:
    """The one constraint ``body`` asks for, with the field that asked; None when none does."""
    found = _requested(body)
    if len(found) > 1:
        fields = ", ".join(param for param, _ in found)
        raise APIError(400, f"Only one structured-output constraint may be given; got {fields}",
                       param=found[1][0])
    return found[0] if found else None


async def check_compiles(engine: AsyncEngine, param: str, structured: StructuredOutput) -> None:
    """400 naming ``param`` unless ``structured`` compiles for ``engine``'s tokenizer (on a
    worker thread: the first compile also builds the grammar engine's vocabulary)."""
    try:
        await asyncio.to_thread(engine.compile_grammar, structured)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from None


async def requested_constraint(engine: AsyncEngine, body: SamplingRequest) -> StructuredOutput | None:
    """The compiled-and-checked constraint ``body`` asks for, or None."""
    found = structured_output(body)
    if found is None:
        return None
    await check_compiles(engine, *found)
    return found[1]
