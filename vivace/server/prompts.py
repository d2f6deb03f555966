"""From a validated request to engine input: body parsing, tokenization, context-length
and token-id checks, sampling parameters. Every failure here is a 400 APIError."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jinja2
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from vivace.engine.sampling_params import SamplingParams
from vivace.engine.step_timing import TimingLog, timed
from vivace.engine.tokenization import encoder_of
from vivace.server.errors import APIError, from_validation_error
from vivace.server.protocol import ChatTemplateRequest, SamplingRequest
from vivace.server.tool_formats import HERMES, ToolFormat
from vivace.server.tools import chat_messages

Schema = TypeVar("Schema", bound=BaseModel)
T = TypeVar("T")
# Prompts this long (characters) are templated and tokenized in a worker thread: about 1,000
# tokens, a few milliseconds of work; shorter ones cost less than the thread hop.
OFF_LOOP_CHARS = 4096
# Bodies this long (bytes) are parsed in a worker thread: ~1 ms of validation and up. Parsing 700,000
# stop token ids (4 MB) held the event loop, every stream's next event, ~90 ms; from a worker
# thread the loop waited ~20 ms at most.
OFF_LOOP_BODY_BYTES = 256 * 1024


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (``application/json`` or a ``+json`` type)."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def parse_body(request: Request, schema: type[Schema], log: TimingLog) -> Schema:
    """The body as ``schema``; 415 when the Content-Type is given and is not JSON, 400 for
    malformed JSON (lone surrogates and NaN included) or a schema violation. Records into ``log``
    how long the parsing took (not the reading)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not is_json(content_type):
        raise APIError(415, f"Unsupported Content-Type '{content_type}': send the body as "
                            "application/json", code="unsupported_media_type")
    raw = await request.body()
    try:
        return await off_the_loop(log, schema.model_validate_json, raw, size=len(raw), threshold=OFF_LOOP_BODY_BYTES)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def off_the_loop(log: TimingLog, work: Callable[..., T], *args: Any, size: int = 0,
                       threshold: int = OFF_LOOP_CHARS) -> T:
    """``work(*args)`` timed into ``log``; in a worker thread when ``size`` (characters of
    input) reaches ``threshold``, so a long prompt's template and tokenization never hold up the
    event loop's other streams (the tokenizer releases the GIL while it encodes)."""
    if size < threshold:
        with timed(log):
            return work(*args)

    def timed_work() -> T:
        with timed(log):
            return work(*args)
    return await asyncio.to_thread(timed_work)


def chat_prompt_ids(tokenizer: Any, body: ChatTemplateRequest, tool_choice: str = "none",
                    add_special_tokens: bool = False, form: ToolFormat = HERMES) -> list[int]:
    """Token ids of the messages (and tools, unless ``tool_choice`` is "none") rendered with
    the model's chat template, or vivace's convention (``vivace.server.tools``; calls written in
    ``form``), with the request's ``chat_template_kwargs`` as template variables."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "This model has no chat template; use /v1/completions",
                       param="messages")
    messages, tools = chat_messages(body, tokenizer, tool_choice, form)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, tokenize=False,
            **(body.chat_template_kwargs or {}))
    except (jinja2.TemplateError, ValueError) as exc:  # ValueError: no final message to continue
        raise APIError(400, f"The chat template rejected the messages: {exc}",
                       param="messages") from None
    except (TypeError, ArithmeticError) as exc:  # a value the template can't compute with: a 400, as in vLLM
        if not body.chat_template_kwargs:
            raise APIError(400, f"The chat template could not render the messages: {exc}",
                           param="messages") from None
        raise APIError(400, f"The chat template could not use chat_template_kwargs: {exc}",
                       param="chat_template_kwargs") from None
    return nonempty(encoder_of(tokenizer)(text, add_special_tokens), "messages")


def template_size(body: ChatTemplateRequest, choice: str) -> int:
    """About how many characters the chat template renders: the messages' text and their calls'
    arguments; tools going to the template count as many as make it worth a worker thread (their
    schemas' JSON: 1,000 tools held the event loop ~115 ms)."""
    calls = sum(len(call.function.arguments_text()) for m in body.messages for call in m.tool_calls or ())
    tools = OFF_LOOP_CHARS if body.tools and choice != "none" else 0
    return sum(len(m.text()) for m in body.messages) + calls + tools


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids of one completions prompt (a string, or ids checked against the vocabulary)."""
    if isinstance(prompt, str):
        return nonempty(encoder_of(tokenizer)(prompt, True), "prompt")
    vocab_size = len(tokenizer)
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"Token id {bad} is outside the vocabulary [0, {vocab_size})",
                       param="prompt")
    return prompt


def nonempty(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise APIError(400, "The prompt is empty", param=param)
    return ids


def fit_max_tokens(prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                   param: str, default: int | None = None, clamp: bool = False) -> int:
    """``max_tokens``; when None, ``default`` (the model's recommended) or all the room left,
    whichever is less; 400 naming both numbers if it won't fit (the prompt's alone when it leaves no
    room at all). With ``clamp`` (Anthropic's
    models stop at their context window) more than the room left is the room left, and only a
    prompt that leaves no room is a 400."""
    room = max_model_len - prompt_tokens
    if clamp and room < 1:
        raise APIError(400, f"prompt is too long: {prompt_tokens} tokens > {max_model_len - 1} maximum (the "
                            f"model's context is {max_model_len} tokens, one at least for the answer)",
                       param=param, code="context_length_exceeded")
    if clamp and max_tokens is not None:
        max_tokens = min(max_tokens, room)
    wanted = max_tokens if max_tokens is not None else max(min(room, default or room), 1)
    if room < 1:  # no max_tokens would fit: say so (as vLLM does), not "lower max_tokens"
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                 f"{prompt_tokens} input tokens, which leaves no room for the completion. Shorten the {param}.",
            param=param, code="context_length_exceeded")
    if prompt_tokens + wanted > max_model_len:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                 f"requested {prompt_tokens + wanted} tokens ({prompt_tokens} in the prompt, "
                 f"{wanted} for the completion). Shorten the {param} or lower max_tokens.",
            param=param, code="context_length_exceeded")
    return wanted


def sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, defaults: Mapping[str, float | int] | None = None
                    ) -> SamplingParams:
    """The engine's SamplingParams for ``body``, ``defaults`` (the engine's ``sampling_defaults``) for
    the sampling fields it left out; 400 if the engine rejects the combination."""
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs, defaults)
    except ValueError as exc:
        raise APIError(400, str(exc), param=getattr(exc, "param", None), code="invalid_value") from None
