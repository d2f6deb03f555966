"""OpenAI response and stream-chunk schemas, plus vivace's llama.cpp-like ``timings`` extra."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from vivace.engine.outputs import RequestOutput, TokenLogprob


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    # With a prediction: its tokens proposed and accepted (in the output), or rejected.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # With a reasoning parser: how many of the completion tokens were thinking.
    completion_tokens_details: CompletionTokensDetails | None = Field(None, exclude_if=lambda value: value is None)

    def add(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        self.prompt_tokens_details.cached_tokens += cached_tokens


class ResponseTimings(BaseModel):
    """Where one request's time went, like llama.cpp's ``timings`` (milliseconds)."""

    queue_ms: float
    prefill_ms: float
    decode_ms: float
    ttft_ms: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_tokens_per_s: float | None
    decode_tokens_per_s: float | None

    @classmethod
    def of(cls, out: RequestOutput, completion_tokens: int, num_choices: int) -> ResponseTimings:
        """Timings of a finished request; ``completion_tokens`` summed over its ``num_choices``."""
        t = out.timings
        prefilled = out.prompt_tokens - out.num_cached_tokens
        decoded = completion_tokens - num_choices  # each choice's first token comes from prefill
        return cls(
            queue_ms=t.queue_time * 1e3, prefill_ms=t.prefill_time * 1e3,
            decode_ms=t.decode_time * 1e3,
            ttft_ms=None if t.first_token is None else (t.first_token - t.arrival) * 1e3,
            prompt_tokens=out.prompt_tokens, cached_tokens=out.num_cached_tokens,
            completion_tokens=completion_tokens,
            prompt_tokens_per_s=prefilled / t.prefill_time if t.prefill_time > 0 else None,
            decode_tokens_per_s=decoded / t.decode_time if t.decode_time > 0 and decoded > 0 else None,
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class CompletionLogprobs(BaseModel):
    """Per token; an echoed prompt's first token has no logprob (null), as in OpenAI's API and vLLM."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one token of a prompt position, keyed by its id."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


def prompt_logprobs_of(entries: list[TokenLogprob | None], num_top: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) its own logprob and rank, and
    its ``num_top`` most likely alternatives (ranks 1 to ``num_top``), keyed by token id."""
    result: PromptLogprobs = []
    for lp in entries:
        if lp is None:
            result.append(None)
            continue
        position = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.token)}
        for rank, (token_id, text, logprob) in enumerate(lp.top[:num_top], start=1):
            position.setdefault(str(token_id), PromptLogprob(logprob=logprob, rank=rank, decoded_token=text))
        result.append(position)
    return result


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, exclude_if=lambda value: value is None)
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """OpenAI's streamed piece of a tool call: the first has ``id``, ``type`` and the name."""

    index: int
    id: str | None = Field(None, exclude_if=lambda value: value is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda value: value is None)
    function: FunctionCallDelta


def _absent_if_none(value: object) -> bool:
    return value is None


class Thought(BaseModel):
    """A thinking model's reasoning (with a reasoning parser), under both names clients read: vLLM's
    and SGLang's older ``reasoning_content`` and vLLM's newer ``reasoning``; absent when none."""

    reasoning_content: str | None = Field(None, exclude_if=_absent_if_none)
    reasoning: str | None = Field(None, exclude_if=_absent_if_none)


def thought(text: str | None) -> dict[str, str | None]:
    """A reasoning text as the fields of a message or delta (:class:`Thought`)."""
    return {"reasoning_content": text, "reasoning": text}


class AssistantMessage(Thought):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda value: not value)
    function_call: FunctionCall | None = Field(None, exclude_if=_absent_if_none)  # the legacy form's one call


class DeltaMessage(Thought):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=lambda value: not value)
    function_call: FunctionCallDelta | None = Field(None, exclude_if=_absent_if_none)  # the legacy form's call


# vLLM's: the stop string or stop token id that ended a choice (null for the end of text, or its length).
StopReason = int | str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: StopReason = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda value: value is None)  # vLLM's


class _Response(BaseModel):
    id: str
    created: int  # when the request came: the same in every chunk of a stream
    model: str
    system_fingerprint: str | None = None
    usage: Usage | None = None
    timings: ResponseTimings | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda value: value is None)  # vLLM's


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionResponse(_Response):
    """Also the shape of each streamed chunk (OpenAI uses ``text_completion`` for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """vLLM's answer to ``/tokenize``: ``token_strs`` only when asked for (else null)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
