"""What ``POST /v1/responses`` answers: OpenAI's Response object, its output items and usage,
in the shape the official client's ``openai.types.responses.Response`` parses."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from vivace.server.responses import ChatTokenLogprob, ResponseTimings, Usage

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)  # with include message.output_text.logprobs


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionToolCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(BaseModel):
    """A thinking model's reasoning (with a reasoning parser), before its message or calls: the
    whole thinking as one ``reasoning_text`` part (as vLLM gives it); no summary, nothing encrypted."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: None = None
    status: ItemStatus = "in_progress"


OutputItem = Annotated[OutputMessage | FunctionToolCall | ReasoningItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache
    cache_write_tokens: int = 0  # OpenAI bills explicit cache writes; vivace has none


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        details = usage.completion_tokens_details
        return cls(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                   total_tokens=usage.total_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=details.reasoning_tokens if details else 0))


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


def _now() -> int:
    return int(time.time())


class ResponseObject(BaseModel):
    """One answer; with ``"stream": true`` its lifecycle events carry it as it stands."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's settings, as OpenAI echoes them.
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    reasoning: dict[str, Any] | None
    metadata: dict[str, str]
    store: bool
    truncation: Literal["disabled"] = "disabled"
    user: str | None
    top_logprobs: int | None = None
    previous_response_id: None = None
    background: bool = False
    timings: ResponseTimings | None = None  # vivace's extra, as on chat completions
