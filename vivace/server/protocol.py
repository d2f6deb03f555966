"""OpenAI request schemas, strict: a field that is unknown, or known but would change the
result in a way vivace does not support yet, is rejected (400 naming it), never ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator

from vivace.engine.sampling_params import SamplingParams

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text"]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # a participant's name; the chat template decides whether it shows

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


def _unsupported(what: str) -> AfterValidator:
    """Rejects any value but an empty one: the field exists in OpenAI's API, not in vivace yet."""
    def reject(value: Any) -> Any:
        if value:
            raise ValueError(f"{what} are not supported")
        return value
    return AfterValidator(reject)


class SamplingRequest(_Strict):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Bookkeeping fields OpenAI clients send; none of them changes the result.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    logit_bias: Annotated[dict[str, float] | None, _unsupported("logit_bias values")] = None
    # vLLM extras
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int | None = None  # lower is sooner; the key's tier sets its default and floor
    # vivace's extra: false keeps this request out of speculative decoding (when the server has it)
    speculative: bool = True

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: Any) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raises ValueError on a combination it rejects."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop_list(), stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            speculative=self.speculative,
        )


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[dict[str, Any]] | None, _unsupported("tools")] = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None  # meaningless without tools
    add_generation_prompt: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: Any) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None
    suffix: Annotated[str | None, _unsupported("suffix (fill-in-the-middle) values")] = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: Any) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported")
        return value

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of strings or a list of token-id lists (one per engine request)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return self.prompt  # type: ignore[return-value]
