"""From a request's structured-output fields to the engine's ``StructuredOutput``: OpenAI's
``response_format``, vLLM's ``structured_outputs`` / ``guided_*`` extras and llama.cpp server's
``grammar`` / ``json_schema``. At most one of
them may constrain a request; one that does not compile is a 400 naming its field, before
anything reaches the engine. vLLM's whitespace pattern (``structured_outputs.whitespace_pattern``,
``guided_whitespace_pattern``) lets JSON take that whitespace between its tokens, unless
``disable_any_whitespace`` is set; ``guided_decoding_backend`` naming another backend than
llguidance is a warning (vLLM V1 serves with one backend too)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import TYPE_CHECKING, Any

from vivace.engine.sampling_params import StructuredOutput
from vivace.server.errors import APIError
from vivace.server.protocol import SamplingRequest

if TYPE_CHECKING:
    from vivace.engine.async_engine import AsyncEngine

ANY_JSON_OBJECT = StructuredOutput("json_schema", '{"type": "object"}')
OUR_BACKENDS = ("auto", "guidance", "llguidance")  # vLLM's names of llguidance, and its default
logger = logging.getLogger("vivace.server")


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


def _whitespace_pattern(body: SamplingRequest) -> tuple[str, str] | None:
    """(field, pattern) of the whitespace JSON may take between its tokens; None: none (compact)."""
    extras = body.structured_outputs
    if extras is not None and extras.disable_any_whitespace:
        return None
    if extras is not None and extras.whitespace_pattern is not None:
        return "structured_outputs.whitespace_pattern", extras.whitespace_pattern
    if body.guided_whitespace_pattern is not None:
        return "guided_whitespace_pattern", body.guided_whitespace_pattern
    return None


def _spaced(structured: StructuredOutput, pattern: str) -> StructuredOutput:
    """JSON ``structured`` with ``pattern`` between its tokens (the schema's own options win)."""
    schema = json.loads(structured.spec)
    layout = {"item_separator": ",", "key_separator": ":", "whitespace_pattern": pattern}
    options = {**layout, **schema.get("x-guidance", {})}
    return StructuredOutput("json_schema", json.dumps({**schema, "x-guidance": options}))


def _structured_output(body: SamplingRequest) -> tuple[str, StructuredOutput] | None:
    """The one constraint ``body`` asks for, with the field that asked; None when none does."""
    found = _requested(body)
    if len(found) > 1:
        fields = ", ".join(param for param, _ in found)
        raise APIError(400, f"Only one structured-output constraint may be given; got {fields}",
                       param=found[1][0])
    if not found:
        return None
    param, structured = found[0]
    whitespace = _whitespace_pattern(body)
    if whitespace is not None and structured.kind == "json_schema":
        structured = _spaced(structured, whitespace[1])
    return param, structured


@functools.lru_cache(maxsize=16)
def _warn_backend(name: str) -> None:
    """Logs once per name: agents send theirs with every request."""
    logger.warning("guided_decoding_backend %r ignored: vivace's structured output is llguidance's", name)


async def check_compiles(engine: AsyncEngine, param: str, structured: StructuredOutput) -> None:
    """400 naming ``param`` unless ``structured`` compiles for ``engine``'s tokenizer (on a
    worker thread: the first compile also builds the grammar engine's vocabulary)."""
    try:
        await asyncio.to_thread(engine.compile_grammar, structured)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from None


async def checked_output(engine: AsyncEngine, body: SamplingRequest) -> tuple[str, StructuredOutput] | None:
    """The constraint ``body`` asks for and the field that asked, checked to compile, its
    whitespace pattern too (400 naming the field); None when none does."""
    backend = body.guided_decoding_backend
    if backend is not None and backend.split(":")[0] not in OUR_BACKENDS:  # vLLM V0 took "name:options"
        _warn_backend(backend)
    whitespace = _whitespace_pattern(body)
    if whitespace is not None:
        await check_compiles(engine, whitespace[0], StructuredOutput("regex", whitespace[1]))
    found = _structured_output(body)
    if found is not None:
        await check_compiles(engine, *found)
    return found


async def requested_constraint(engine: AsyncEngine, body: SamplingRequest) -> StructuredOutput | None:
    """The compiled-and-checked constraint ``body`` asks for, or None."""
    found = await checked_output(engine, body)
    return None if found is None else found[1]
