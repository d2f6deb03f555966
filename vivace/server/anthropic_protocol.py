"""The requests of Anthropic's Messages API (``POST /v1/messages`` and
``POST /v1/messages/count_tokens``), strict as Anthropic's own API and vivace's other endpoints
(``vivace.server.protocol``): an unknown field, or a block or tool vivace can't serve (images,
documents, server tools), is a 400 naming it.

A request is answered as chat completions answer its conversation: :meth:`MessagesPrompt.
chat_request` turns ``system`` into a system message, an assistant's text, thinking and
``tool_use`` blocks into one assistant message (its content, ``reasoning_content`` and tool
calls), a user's ``tool_result`` blocks into tool messages and its text into a user message, and
the tools into chat's function tools; a conversation that ends with an assistant's turn is that
turn's prefill (chat's ``continue_final_message``). Text blocks of one turn are joined by a blank
line."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from vivace.server.protocol import (
    FUNCTION_NAME, CacheControl, ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, Integer,
    JsonSchemaFormat, NamedToolChoice, Number, ResponseFormat, TemplateKwargs, Tool, ToolCall, ToolChoiceFunction,
    _Strict, _unsupported, only_types)

BLOCK_SEPARATOR = "\n\n"
_TEXT_ONLY = "vivace serves the model's text only, so images, documents and search results are not supported"


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[list[Any] | None, *_unsupported("citations", {"maxItems": 0})] = None


class ToolUseBlock(_Strict):
    """A call the assistant made, sent back with its result."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    """A call's result: the tool message of chat completions (``is_error``: its text follows
    ``Error:``)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock, only_types(("text",), "tool_result content blocks", _TEXT_ONLY)]
                        ] | None = None
    is_error: bool | None = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = _joined(self.content or "")
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Strict):
    """An earlier answer's thinking, sent back: the thinking of its assistant turn (the chat
    template's ``reasoning_content``). Its signature is not checked."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(_Strict):
    """Thinking encrypted by Anthropic: nothing vivace can read, so it is left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


def _tag(key: str) -> Callable[[Any], str | None]:
    """Which member of a union a value is: its ``key`` field (a dict's or a model's), when a string."""
    def tag(value: Any) -> str | None:
        found = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
        return found if isinstance(found, str) else None
    return tag


UserBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolResultBlock, Tag("tool_result")],
    Discriminator(_tag("type"), custom_error_type="unsupported_block", custom_error_message=(
        "a user message's content blocks must be of type text or tool_result (tool_use and thinking blocks "
        f"are the assistant's): {_TEXT_ONLY}"))]
AssistantBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ThinkingBlock, Tag("thinking")] | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_tag("type"), custom_error_type="unsupported_block", custom_error_message=(
        "an assistant message's content blocks must be of type text, tool_use, thinking or redacted_thinking "
        "(server tools' blocks are not supported: vivace runs no tools itself)"))]


class UserTurn(_Strict):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantTurn(_Strict):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


# Told apart by a function, not by a "role" discriminator: the published schema then has no OpenAPI
# discriminator, which schemathesis can't generate failing cases of.
InputMessage = Annotated[
    Annotated[UserTurn, Tag("user")] | Annotated[AssistantTurn, Tag("assistant")],
    Discriminator(_tag("role"), custom_error_type="unsupported_role", custom_error_message=(
        "a message's role must be user or assistant (the system prompt is the request's system field)"))]


class ToolDefinition(_Strict):
    """A client tool: chat's function tool (``input_schema`` its parameters)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any] = Field(json_schema_extra={"properties": {"type": {"const": "object"}},
                                                           "required": ["type"]})
    strict: bool | None = None  # vivace holds every call to its schema with a grammar anyway
    # Anthropic's fine-grained tool streaming (the Vercel AI SDK sends true when it streams): vivace
    # streams every tool's input as it is written, which its grammar keeps valid, either way.
    eager_input_streaming: bool | None = None
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError('must be a JSON schema of "type": "object" (a tool takes an object as input)')
        return value


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = False


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = False


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = False


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]
_CHAT_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool": a named function
ThinkingDisplay = Literal["summarized", "omitted"]


class ThinkingEnabled(_Strict):
    """Thinking on: with a reasoning parser the model's thinking comes as thinking blocks (the
    model thinks as long as it does: ``budget_tokens`` is checked, not enforced; ``max_tokens``
    bounds thinking and answer together); a model served without one answers without them."""

    type: Literal["enabled"]
    budget_tokens: Integer(ge=1024)
    display: ThinkingDisplay | None = None


class ThinkingAdaptive(_Strict):
    type: Literal["adaptive"]
    display: ThinkingDisplay | None = None


class ThinkingDisabled(_Strict):
    """Thinking off: chat's ``reasoning_effort: "none"`` (qwen3's ``enable_thinking: false``; a 400
    with deepseek_r1, which always thinks)."""

    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """``format``: the answer as JSON of a schema (chat's ``response_format``). ``effort`` is a hint
    with no effect: the served model's answers run as long as they do."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)


def _joined(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else BLOCK_SEPARATOR.join(block.text for block in content)


# Claude Code opens its system prompt with a line of client analytics whose hash (cch=) changes on
# every request: left in, no two requests would share a cached prefix past its first tokens.
_BILLING_HEADER = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)


def _system_prompt(content: str | list[TextBlock]) -> str:
    """The system prompt the model reads: the blocks joined, without Claude Code's billing header
    line (vLLM drops it too), which means nothing to the model; a block that held only that line
    goes with it."""
    blocks = [content] if isinstance(content, str) else [block.text for block in content]
    kept = [(text, _BILLING_HEADER.sub("", text)) for text in blocks]
    return BLOCK_SEPARATOR.join(stripped for text, stripped in kept if stripped or stripped == text)


class MessagesPrompt(_Strict):
    """What is rendered into the prompt: the body of ``/v1/messages/count_tokens``."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Annotated[ToolDefinition, only_types(("custom",), "tools", (
        "vivace serves client tools only (no type, or custom): server tools such as web search, code "
        "execution, bash or the text editor run on Anthropic's side"))]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    # vLLM's extra: variables for the chat template
    chat_template_kwargs: TemplateKwargs | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The conversation as chat completions take it (the module docstring says how)."""
        return ChatCompletionRequest(**self._chat_fields())

    def _chat_fields(self) -> dict[str, Any]:
        choice = self.tool_choice
        chat_choice: Any = None if choice is None else _CHAT_TOOL_CHOICES.get(choice.type)
        if isinstance(choice, ToolChoiceTool):
            chat_choice = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
        form = self.output_config.format if self.output_config is not None else None
        prefill = self.messages[-1].role == "assistant"
        return dict(
            model=self.model, messages=self._messages(), tool_choice=chat_choice,
            tools=[Tool(type="function", function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict))
                for t in self.tools] if self.tools else None,
            parallel_tool_calls=not getattr(choice, "disable_parallel_tool_use", False),
            response_format=None if form is None else ResponseFormat(
                type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=form.schema_)),
            reasoning_effort="none" if isinstance(self.thinking, ThinkingDisabled) else None,
            chat_template_kwargs=self.chat_template_kwargs,
            add_generation_prompt=not prefill, continue_final_message=prefill)

    def _messages(self) -> list[ChatMessage]:
        messages = [] if self.system is None else [ChatMessage(role="system", content=_system_prompt(self.system))]
        for message in self.messages:
            if isinstance(message.content, str):
                messages.append(ChatMessage(role=message.role, content=message.content))
            elif isinstance(message, AssistantTurn):
                messages.append(_assistant_turn(message.content))
            else:
                messages += _user_turn(message.content)
        return messages

    def show_thinking(self) -> bool:
        """Whether thinking blocks carry their text (``display: "omitted"``: the signature only)."""
        return getattr(self.thinking, "display", None) != "omitted"


def _assistant_turn(blocks: list[Any]) -> ChatMessage:
    texts = [block.text for block in blocks if isinstance(block, TextBlock)]
    thoughts = [block.thinking for block in blocks if isinstance(block, ThinkingBlock)]
    calls = [ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=json.dumps(block.input)))
             for block in blocks if isinstance(block, ToolUseBlock)]
    return ChatMessage(role="assistant", content=BLOCK_SEPARATOR.join(texts), tool_calls=calls or None,
                       reasoning_content=BLOCK_SEPARATOR.join(thoughts) if thoughts else None)


def _user_turn(blocks: list[Any]) -> list[ChatMessage]:
    """Each tool result a tool message, the text between them a user message, in their order."""
    messages, texts = [], []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if texts:
                messages.append(ChatMessage(role="user", content=BLOCK_SEPARATOR.join(texts)))
                texts = []
            messages.append(ChatMessage(role="tool", content=block.text(), tool_call_id=block.tool_use_id))
        else:
            texts.append(block.text)
    if texts or not messages:
        messages.append(ChatMessage(role="user", content=BLOCK_SEPARATOR.join(texts)))
    return messages


class MessagesRequest(MessagesPrompt):
    """The body of ``/v1/messages``. ``metadata`` and ``service_tier`` are bookkeeping, accepted
    with no effect; ``top_k`` 0 means no top-k."""

    max_tokens: Integer(ge=1)
    stop_sequences: list[str] | None = None
    temperature: Number(ge=0.0, le=1.0) | None = None  # None: the server's default, as chat's
    top_p: Number(gt=0.0, le=1.0) | None = None
    top_k: Integer(ge=0) | None = None
    stream: bool | None = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # vLLM's sampling extras, as chat completions take them
    seed: Integer(ge=-(2**63), lt=2**64) | None = None
    min_p: Number(ge=0.0, le=1.0) | None = None
    repetition_penalty: Number(gt=0.0, le=100.0) | None = None
    ignore_eos: bool | None = False
    priority: Integer() | None = None

    @field_validator("max_tokens")
    @classmethod
    def _above_thinking_budget(cls, value: int, info: Any) -> int:
        thinking = info.data.get("thinking")
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= value:
            raise ValueError("must be more than thinking.budget_tokens (the thinking counts toward max_tokens)")
        return value

    def chat_request(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(
            **self._chat_fields(), max_tokens=self.max_tokens, stop=self.stop_sequences,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, priority=self.priority)
