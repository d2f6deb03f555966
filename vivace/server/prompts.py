"""From a validated request to engine input: body parsing, tokenization, context-length
and token-id checks, sampling parameters. Every failure here is a 400 APIError."""

from __future__ import annotations

from typing import Any, TypeVar

import jinja2
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from vivace.engine.sampling_params import SamplingParams
from vivace.server.errors import APIError, from_validation_error
from vivace.server.protocol import ChatCompletionRequest, SamplingRequest

Schema = TypeVar("Schema", bound=BaseModel)


async def parse_body(request: Request, schema: type[Schema]) -> Schema:
    """The body as ``schema``; 400 for malformed JSON (lone surrogates and NaN included) or a
    schema violation."""
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def chat_prompt_ids(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    """Token ids of the messages rendered with the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "This model has no chat template; use /v1/completions",
                       param="messages")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=False)
    except jinja2.TemplateError as exc:
        raise APIError(400, f"The chat template rejected the messages: {exc}",
                       param="messages") from None
    return nonempty(tokenizer.encode(text, add_special_tokens=False), "messages")


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids of one completions prompt (a string, or ids checked against the vocabulary)."""
    if isinstance(prompt, str):
        return nonempty(tokenizer.encode(prompt), "prompt")
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
                   param: str) -> int:
    """``max_tokens``, or all the room left when None; 400 naming both numbers if it won't fit."""
    room = max_model_len - prompt_tokens
    wanted = max_tokens if max_tokens is not None else max(room, 1)
    if prompt_tokens + wanted > max_model_len:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                 f"requested {prompt_tokens + wanted} tokens ({prompt_tokens} in the prompt, "
                 f"{wanted} for the completion). Shorten the {param} or lower max_tokens.",
            param=param, code="context_length_exceeded")
    return wanted


def sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for ``body``; 400 if the engine rejects the combination."""
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None
