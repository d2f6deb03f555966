"""What ``POST /v1/messages`` answers: Anthropic's Message, its content blocks and usage, in the
shape the official client's ``anthropic.types.Message`` parses; and count_tokens' answer."""

from __future__ import annotations

import hashlib
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from vivace.server.responses import ResponseTimings, Usage

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text. Anthropic's seals the thinking for its
    own checks; vivace checks none sent back, so any string the client keeps will do."""
    return hashlib.sha256(thinking.encode()).hexdigest()


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str = ""


class ThinkingContent(BaseModel):
    """A thinking model's thinking (with a reasoning parser), before its answer."""

    type: Literal["thinking"] = "thinking"
    thinking: str = ""
    signature: str = ""


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, object] = Field(default_factory=dict)


ContentBlock = Annotated[TextContent | ThinkingContent | ToolUseContent, Field(discriminator="type")]


class ThinkingTokens(BaseModel):
    thinking_tokens: int


class MessageUsage(BaseModel):
    """Anthropic's token counts: ``input_tokens`` are the prompt's tokens not read from the cache
    (the prefix cache's hits are ``cache_read_input_tokens``; the two make the whole prompt)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0  # the prefix cache fills itself: no writes are billed apart
    cache_read_input_tokens: int = 0
    # With a reasoning parser: how many of the output tokens were thinking.
    output_tokens_details: ThinkingTokens | None = Field(None, exclude_if=lambda value: value is None)

    @classmethod
    def of(cls, usage: Usage) -> MessageUsage:
        cached, details = usage.prompt_tokens_details.cached_tokens, usage.completion_tokens_details
        return cls(input_tokens=usage.prompt_tokens - cached, cache_read_input_tokens=cached,
                   output_tokens=usage.completion_tokens,
                   output_tokens_details=None if details is None else ThinkingTokens(
                       thinking_tokens=details.reasoning_tokens))


class Message(BaseModel):
    """One answer; a stream's ``message_start`` carries it before any content."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage
    timings: ResponseTimings | None = Field(None, exclude_if=lambda value: value is None)  # vivace's extra


class TokenCount(BaseModel):
    input_tokens: int
