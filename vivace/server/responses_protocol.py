"""The request of OpenAI's Responses API (``POST /v1/responses``), the stateless subset vLLM
serves, strict as the other endpoints' (``vivace.server.protocol``): an unknown field, or one
whose value would change the answer in a way vivace can't honour, is a 400 naming it.

A request is answered as chat completions answer its conversation: :meth:`ResponsesRequest.
chat_request` turns ``instructions`` and ``input`` into chat messages (function calls into an
assistant's tool calls, their outputs into tool messages) and the flat function tools into
chat's, so the template, sampling, tools and structured output are chat's own. Nothing is
stored: ``previous_response_id`` and ``conversation`` are refused."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, field_validator

from vivace.engine.sampling_params import MAX_LOGPROBS
from vivace.server.errors import APIError
from vivace.server.responses_objects import ItemStatus
from vivace.server.protocol import (
    ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, Integer, JsonSchemaFormat,
    NamedToolChoice, Number, ReasoningEffort, ResponseFormat, Tool, ToolCall, ToolChoiceFunction, Verbosity, _Strict,
    only_types)

NOT_STORED = ("vivace stores no responses (it keeps no state between requests): send the whole "
              "conversation in input")


def _refused(message: str) -> BeforeValidator:
    """Rejects any value but null (the field's schema allows null only) with ``message``."""
    def refuse(value: Any) -> Any:
        if value is not None:
            raise ValueError(message)
        return value
    return BeforeValidator(refuse)


class ContentPart(_Strict):
    """Text of a message: ``input_text``, or ``output_text`` of an earlier answer sent back."""

    type: Literal["input_text", "output_text"]
    text: str
    # An earlier answer's, as the client dumps it: neither changes what the model sees.
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


Content = str | list[Annotated[ContentPart, only_types(
    ("input_text", "output_text"), "content parts", "the model takes text only (input_text, output_text)")]]


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    # What an earlier answer's message carries when it is sent back.
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallInput(_Strict):
    """An earlier answer's function call, sent back with its output."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str | dict[str, Any]  # a JSON object as text, or the object (as chat's history takes it)
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputInput(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Content
    id: str | None = None
    status: ItemStatus | None = None


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningInput(_Strict):
    """An earlier answer's reasoning item, sent back: its text becomes the thinking of the
    assistant turn it belongs to (the chat template's ``reasoning_content``)."""

    type: Literal["reasoning"]
    summary: list[SummaryText]
    content: list[ReasoningText] | None = None
    encrypted_content: Annotated[None, _refused("vivace encrypts no reasoning and can't read encrypted "
                                                "content: send the item as vivace gave it")] = None
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        """Its reasoning text (the summary's, without one)."""
        return "".join(part.text for part in (self.content or self.summary))


def _item_kind(item: Any) -> str:
    """An item's tag: its ``type``; a message may leave it out (or null)."""
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")] | Annotated[ReasoningInput, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="unsupported_item",
                  custom_error_message="input items must be messages, function_call, function_call_output or "
                                       "reasoning items (item_reference and built-in tools' items are not "
                                       "supported)")]


class FunctionTool(FunctionDefinition):
    """A function tool as the Responses API gives it: chat's definition, flat, with its type."""

    type: Literal["function"]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class PlainText(_Strict):
    type: Literal["text"]


class JsonObject(_Strict):
    type: Literal["json_object"]


class JsonSchemaText(_Strict):
    type: Literal["json_schema"]
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: Annotated[PlainText | JsonObject | JsonSchemaText, Field(discriminator="type")] | None = None
    verbosity: Verbosity | None = None  # a hint for GPT models; the served model's length is its own


class Reasoning(_Strict):
    """How much to think. Without a reasoning parser the served model doesn't reason: only
    "none" (or no effort) is accepted. With one, qwen3's "none" turns thinking off (the template's
    ``enable_thinking: false``), deepseek_r1 can't (400); any other effort lets the model think as
    long as it does. No summary is written: the reasoning item carries the whole thinking."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Integer(ge=1) | None = None
    temperature: Number(ge=0.0, le=100.0) | None = None  # None: the server's default, as chat's
    top_p: Number(gt=0.0, le=1.0) | None = None
    stream: bool | None = False
    tools: list[Annotated[FunctionTool, only_types(("function",), "tools", "vivace serves function tools only")]
                ] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    # Reasoning items carry their text in the clear: there is no encrypted reasoning to include.
    # The answer's logprobs (with "message.output_text.logprobs"), each with its top_logprobs
    # alternatives, as vLLM serves them: for a plain text answer (no tools to call).
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] | None = None
    top_logprobs: Integer(ge=0, le=MAX_LOGPROBS) | None = None
    truncation: Literal["disabled"] | None = None
    # Bookkeeping: none of these changes the answer (store: nothing is kept either way).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    previous_response_id: Annotated[None, _refused(NOT_STORED)] = None
    conversation: Annotated[None, _refused(NOT_STORED)] = None
    background: Annotated[None, _refused("background responses need stored responses, which vivace "
                                         "doesn't keep: leave background out")] = None
    # vLLM's sampling extras, as chat completions take them
    seed: Integer(ge=-(2**63), lt=2**64) | None = None
    stop: str | list[str] | None = None
    top_k: Integer(ge=-1) | None = None
    min_p: Number(ge=0.0, le=1.0) | None = None
    repetition_penalty: Number(gt=0.0, le=100.0) | None = None
    presence_penalty: Number(ge=-2.0, le=2.0) | None = 0.0
    frequency_penalty: Number(ge=-2.0, le=2.0) | None = 0.0
    ignore_eos: bool | None = False
    priority: Integer() | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM's: prefix-cache hits per salt

    @field_validator("include")
    @classmethod
    def _logprobs_of_text(cls, value: list[str] | None, info: Any) -> list[str] | None:
        if "message.output_text.logprobs" in (value or []) and info.data.get("tools") and (
                info.data.get("tool_choice") != "none"):
            raise ValueError("message.output_text.logprobs are served for text answers only: leave it out, "
                             "or set tool_choice to \"none\"")
        return value

    def output_logprobs(self) -> bool:
        """Whether the answer's text comes with its tokens' logprobs."""
        return "message.output_text.logprobs" in (self.include or [])

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as chat completions take it; 400 for a function call's arguments that
        are not a JSON object."""
        tools = [Tool(type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"})))
                 for t in self.tools or []]
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
        return ChatCompletionRequest(
            model=self.model, messages=self._messages(), tools=tools or None, tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, response_format=self._response_format(),
            seed=self.seed, stop=self.stop, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, ignore_eos=self.ignore_eos, priority=self.priority,
            cache_salt=self.cache_salt, reasoning_effort=self.reasoning.effort if self.reasoning is not None else None,
            logprobs=self.output_logprobs(), top_logprobs=self.top_logprobs if self.output_logprobs() else None)

    def _response_format(self) -> ResponseFormat | None:
        form = self.text.format if self.text is not None else None
        if isinstance(form, JsonSchemaText):
            return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
                name=form.name, description=form.description, schema=form.schema_, strict=form.strict))
        return ResponseFormat(type=form.type) if form is not None else None

    def _messages(self) -> list[ChatMessage]:
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, ReasoningInput):  # the thinking that opens an assistant turn
                messages.append(ChatMessage(role="assistant", content="", reasoning_content=item.text()))
            elif isinstance(item, InputMessage) and item.role == "assistant" and _thought_only(messages):
                messages[-1].content = _text(item.content)  # the answer its thinking led to
            elif isinstance(item, InputMessage):
                messages.append(ChatMessage(role=item.role, content=_text(item.content)))
            elif isinstance(item, FunctionCallOutputInput):
                messages.append(ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id))
            else:
                call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                if messages and messages[-1].role == "assistant":  # one turn: its text, then its calls
                    messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
                else:
                    messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        return messages


def _thought_only(messages: list[ChatMessage]) -> bool:
    """Whether the last message is an assistant's thinking, without its answer or calls yet."""
    last = messages[-1] if messages else None
    return (last is not None and last.role == "assistant" and last.reasoning_content is not None
            and not last.content and not last.tool_calls)

