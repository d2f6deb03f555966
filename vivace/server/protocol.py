"""OpenAI request schemas, strict: a field that is unknown, or known but would change the
result in a way vivace does not support yet, is rejected (400 naming it), never ignored; and a
value of the wrong JSON type is not coerced (``"stream": "yes"`` is a 400, as in OpenAI's API).
``null`` for an optional field means its default, as in OpenAI's API and vLLM (clients that
serialize every field send ``"temperature": null``).
These models are also the published contract: ``/openapi.json`` is generated from them."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator)
from pydantic.fields import FieldInfo

from vivace.engine.sampling_params import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 2.0; the strict models take an integral float as its int
    (2.5, "2" and true stay errors), so the server accepts what its published schema allows."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Integer(**bounds: int) -> Any:
    """An integer field type with JSON Schema bounds (``ge=0``...). The bounds come before the
    validator that takes integral floats, so the schema states them as ``minimum``/``maximum``
    (after it, or as a ``Field`` on an optional, pydantic writes its own ``ge`` keys, which JSON
    Schema tools ignore)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def Number(**bounds: float) -> Any:
    """A float field type with JSON Schema bounds (a ``Field`` on an optional would write
    pydantic's own ``ge`` keys instead)."""
    return Annotated[float, Field(**bounds)]


TokenIds = Annotated[list[Integer(ge=0)], Field(min_length=1)]
# A token id as a JSON object's key (logit_bias): decimal, no sign, no leading zero.
TOKEN_ID_KEY = r"^(0|[1-9][0-9]{0,9})$"
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)], Number(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)],
    Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})]
# What transformers' apply_chat_template and the template renderer set themselves: a template
# variable of chat_template_kwargs can't be one of these (the request has its own field for some).
RESERVED_TEMPLATE_VARIABLES = (
    "messages", "conversation", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def _free_template_variables(value: dict[str, Any]) -> dict[str, Any]:
    taken = [name for name in value if name in RESERVED_TEMPLATE_VARIABLES]
    if taken:
        raise ValueError(f"{taken[0]!r} can't be a template variable: vivace sets it (add_generation_prompt, "
                         "continue_final_message and tools are fields of the request itself)")
    return value


# What a sampling field a request leaves out (or sends as null) is when the server has no default of
# its own for it (vivace.generation_config: the model's recommended values, --override-generation-config).
SAMPLING_FALLBACKS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}

TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_free_template_variables), Field(
    json_schema_extra={"propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_VARIABLES)}}})]
# An empty prompt has nothing to continue from: the schema says so, and the server agrees.
PromptText = Annotated[str, Field(min_length=1)]
# A grammar (GBNF or Lark) has at least its root rule: the published schema refuses an empty one.
GrammarText = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    # Fields whose ``null`` means something of its own (not the default): see CompletionRequest.
    null_is_none: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="after")
    def _null_means_default(self) -> Self:
        """A field typed ``T | None`` with a default other than None takes that default for
        ``null``, so the rest of vivace never sees None there (but ``null_is_none`` fields sent
        as null)."""
        for name, info in _defaults_not_none(type(self)):
            if getattr(self, name) is None and not (name in self.null_is_none and name in self.model_fields_set):
                setattr(self, name, info.get_default(call_default_factory=True))
        return self


@functools.cache
def _defaults_not_none(model: type[BaseModel]) -> tuple[tuple[str, FieldInfo], ...]:
    """The optional fields of ``model`` whose default is not None: the only ones null changes. Found
    once per model, not per object (a body of 20,000 messages spent ~150 ms on the event loop
    going through every field of every message)."""
    return tuple((name, info) for name, info in model.model_fields.items()
                 if not info.is_required() and (info.default_factory is not None or info.default is not None))


def _unsupported(what: str, empty: dict[str, int]) -> tuple[AfterValidator, Any]:
    """Rejects any value but an empty one: the field exists in OpenAI's API, not in vivace yet.
    ``empty`` is the JSON-schema bound that publishes the same rule (e.g. ``maxItems: 0``)."""
    def reject(value: Any) -> Any:
        if value:
            raise ValueError(f"{what} are not supported")
        return value
    return AfterValidator(reject), Field(json_schema_extra=empty)


def only_types(kinds: tuple[str, ...], what: str, why: str) -> BeforeValidator:
    """A tagged object whose ``type`` is outside ``kinds`` is a clear 400, not a literal's error."""
    def check(data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] not in kinds:
            raise ValueError(f"{what} of type {data['type']!r} are not supported: {why}")
        return data
    return BeforeValidator(check)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    # vLLM's extra: every chunk carries the usage so far (with include_usage only)
    continuous_usage_stats: bool | None = False
    # OpenAI's padding of stream events against size side channels: vivace adds none, either way
    include_obfuscation: bool | None = None

    @field_validator("continuous_usage_stats")
    @classmethod
    def _needs_usage(cls, value: bool | None, info: Any) -> bool | None:
        if value and not info.data.get("include_usage"):
            raise ValueError("continuous_usage_stats needs include_usage set to true")
        return value


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: at most one of its constraints (``json`` ... ``json_object``)
    constrains the output, and its options shape JSON (``vivace.server.structured``)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None
    # JSON is compact unless a whitespace pattern is given and disable_any_whitespace is not true;
    # objects that list their properties take no others (as xgrammar reads them), either way.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


class CacheControl(_Strict):
    """A prompt-caching breakpoint (Anthropic's, which OpenRouter and LiteLLM pass on in chat
    requests), a hint only: vivace's prefix cache keeps what it has room for of every prompt, with
    no breakpoints to set (``usage`` counts its hits)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class FunctionCall(_Strict):
    name: str
    # A JSON object as text (OpenAI's form); LangChain and other clients send the object itself,
    # which vLLM accepts too.
    arguments: str | dict[str, Any]
    # What the openai client's ``chat.completions.parse`` adds to a call it read, sent back with the
    # message: ``arguments`` read into the tool's model (ignored: the text is what was said).
    parsed_arguments: Any = None

    def arguments_text(self) -> str:
        """The arguments as text: an object as ``json.dumps`` writes it."""
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    # A streamed call's position, which clients that assemble calls from a stream's deltas send
    # back (vLLM takes it); the list's order is the calls' own.
    index: int | None = None


FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition
    cache_control: CacheControl | None = None


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] != "text":
            raise ValueError(f"content parts of type {data['type']!r} are not supported: the model "
                             "takes text only (parts of type 'text')")
        return data


class ChatMessage(_Strict):
    # "function": OpenAI's legacy tool result (vivace.server.functions), with the function's ``name``
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # a participant's name; the chat template decides whether it shows
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only: the call this is the result of
    # What an OpenAI client's ``message.model_dump()`` carries when an answer is sent back.
    refusal: str | None = None  # an assistant's refusal: its text when it has no content
    # An assistant's thinking (a reasoning parser's answer carries both names, as vLLM's old and new
    # ones); the chat template gets it as ``reasoning_content``, which Qwen3's renders.
    reasoning_content: str | None = None
    reasoning: str | None = None
    annotations: Annotated[list[Any] | None, *_unsupported("annotations", {"maxItems": 0})] = None
    audio: None = None
    parsed: Any = None  # ``chat.completions.parse``'s content read into the response_format's model (ignored)
    function_call: FunctionCall | None = None  # an assistant's call in OpenAI's legacy form (one, no id)
    cache_control: CacheControl | None = None

    def text(self) -> str:
        """The content as the chat template gets it: text parts joined by newlines, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or self.refusal or ""

    def thinking(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


class SamplingRequest(_Strict):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: Integer(ge=1, le=128) | None = 1
    # None: the server's default (SAMPLING_FALLBACKS, unless the model recommends its own)
    temperature: Number(ge=0.0, le=100.0) | None = None
    top_p: Number(gt=0.0, le=1.0) | None = None
    presence_penalty: Number(ge=-2.0, le=2.0) | None = 0.0
    frequency_penalty: Number(ge=-2.0, le=2.0) | None = 0.0
    seed: Integer(ge=-(2**63), lt=2**64) | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Bookkeeping fields OpenAI clients send; none of them changes the result.
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of ``user``, with prompt_cache_key
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None  # the prefix cache keeps what fits, for as long as it fits
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    logit_bias: LogitBias | None = None  # token id (as text) -> bias added to its logit
    # vLLM extras
    top_k: Integer(ge=-1) | None = None
    min_p: Number(ge=0.0, le=1.0) | None = None
    repetition_penalty: Number(gt=0.0, le=100.0) | None = None
    ignore_eos: bool | None = False
    min_tokens: Integer(ge=0) | None = 0
    stop_token_ids: list[Integer(ge=0)] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    priority: Integer() | None = None  # lower is sooner; the key's tier sets its default and floor
    # vivace's extra: false keeps this request out of speculative decoding (when the server has it)
    speculative: bool | None = True
    # vLLM's extra: prefix-cache hits only among requests with the same salt (one per tenant)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's extra: each prompt token's logprob and its k most likely alternatives (not streamed)
    prompt_logprobs: Integer(ge=0, le=MAX_LOGPROBS) | None = None
    # Structured output (vivace.server.structured): OpenAI's response_format, vLLM's and llama.cpp's extras.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: GrammarText | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # vivace's is llguidance: another is a warning, as in vLLM V1
    # llama.cpp server's names: a GBNF grammar, a JSON schema
    grammar: GrammarText | None = None
    json_schema: dict[str, Any] | None = None

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: Any) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_whole(cls, value: int | None, info: Any) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Whether every chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        """The engine's parameters, ``defaults`` (else SAMPLING_FALLBACKS) for the sampling fields
        the request left out; raises ValueError on a combination the engine rejects."""
        given = defaults or {}
        sampling = {name: given.get(name, fallback) if getattr(self, name) is None else getattr(self, name)
                    for name, fallback in SAMPLING_FALLBACKS.items()}
        return SamplingParams(
            n=self.n, **sampling,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop_list(), stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            speculative=self.speculative, cache_salt=self.cache_salt,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
        )


class ChatTemplateRequest(_Strict):
    """What the chat template renders (chat completions and ``/tokenize``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # "none": tools not rendered
    add_generation_prompt: bool | None = True
    # vLLM's extras: the last (assistant) message is left open and the answer continues it;
    # variables for the template (e.g. Qwen3's {"enable_thinking": false}).
    continue_final_message: bool | None = False
    chat_template_kwargs: TemplateKwargs | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _continue_without_new_turn(cls, value: bool | None, info: Any) -> bool | None:
        if value and info.data.get("add_generation_prompt") is not False:
            raise ValueError("continue_final_message needs add_generation_prompt set to false")
        return value


class PredictionContent(_Strict):
    """OpenAI's predicted output: text the answer is expected to mostly repeat (a file being edited).
    It changes only how fast the answer comes (vivace.engine.prediction), never what it is."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
Verbosity = Literal["low", "medium", "high"]


class ChatCompletionRequest(ChatTemplateRequest, SamplingRequest):
    max_tokens: Integer(ge=1) | None = None
    max_completion_tokens: Integer(ge=1) | None = None
    logprobs: bool | None = False
    top_logprobs: Integer(ge=0, le=MAX_LOGPROBS) | None = None
    parallel_tool_calls: bool | None = True
    # OpenAI's legacy form of tools and tool_choice, still served (vivace.server.functions)
    functions: Annotated[list[FunctionDefinition], Field(min_length=1)] | None = None
    function_call: Literal["none", "auto"] | ToolChoiceFunction | None = None
    # OpenAI's: how much a reasoning model thinks (vivace.server.reasoning.effort_template_kwargs)
    reasoning_effort: ReasoningEffort | None = None
    # OpenAI's hints that change nothing here: how long a GPT model's answers run (the served
    # model's length is its own), and the output's modalities (text is all vivace writes; "audio"
    # is a 400).
    verbosity: Verbosity | None = None
    modalities: list[Literal["text"]] | None = None
    # OpenAI's predicted output: proposals for speculative decoding (vivace.engine.prediction)
    prediction: PredictionContent | None = None

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
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: Integer(ge=0) | None = 16  # 0 with echo only: the prompt (and its logprobs), nothing generated
    null_is_none = frozenset({"max_tokens"})  # vLLM's: max_tokens null is all the room the context has
    echo: bool | None = False
    logprobs: Integer(ge=0, le=MAX_LOGPROBS) | None = None
    best_of: Integer() | None = None
    suffix: Annotated[str | None, *_unsupported("suffix (fill-in-the-middle) values", {"maxLength": 0})] = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: Any) -> int | None:
        if value is not None and value != (info.data.get("n") or 1):
            raise ValueError("best_of other than n is not supported")
        return value

    def requested_max_tokens(self, has_default: bool) -> int | None:
        """The request's max_tokens, None for the server's default or all the room left: what null asks,
        and what leaving it out asks of a server with a default (without one it is 16, OpenAI's)."""
        return self.max_tokens if "max_tokens" in self.model_fields_set or not has_default else None

    def requested_prompt_logprobs(self) -> int | None:
        """The engine's ``prompt_logprobs``: vLLM's field, and with ``echo`` and ``logprobs`` the
        alternatives the echoed prompt's tokens show (the more of the two when both are set)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of strings or a list of token-id lists (one per engine request)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return self.prompt  # type: ignore[return-value]


class TokenizeCompletionRequest(_Strict):
    """vLLM's ``/tokenize`` of a text."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateRequest):
    """vLLM's ``/tokenize`` of messages, rendered as chat completions renders them."""

    model: str | None = None
    add_special_tokens: bool | None = False
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Integer(ge=0)]
