"""OpenAI's legacy function calling, which OpenAI still serves and older clients still send
(LangChain's ``FunctionMessage`` and function agents, code written before tools, proxies that pass
a caller's ``functions`` through): ``functions`` are tools, ``function_call`` the tool choice, and
at most one call is made, as the legacy API makes one. The answer comes in the legacy shape:
``message.function_call`` (``delta.function_call`` in a stream) and ``finish_reason:
"function_call"``. In the history an assistant's ``function_call`` is a tool call and a
``role: "function"`` message (with the function's ``name``) is its result.
"""

from __future__ import annotations

import re

from vivace.server.errors import APIError, renamed
from vivace.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool, ToolCall
from vivace.server.responses import ChatChoice, ChatChunkChoice

# Chat's names for the legacy fields, in the errors of a request that sent ``functions``.
_RENAMES = [
    (re.compile(r"^tools\.(\d+)\.function\."), r"functions.\1."),
    (re.compile(r"^tools(?=\.|$)"), "functions"),
    (re.compile(r"^tool_choice\.function\."), "function_call."),
    (re.compile(r"^tool_choice(?=\.|$)"), "function_call"),
]


def as_tools(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """``body`` with its ``functions`` as tools and ``function_call`` as the tool choice, one call
    at most; ``body`` itself when it has no functions. 400 for functions beside tools, a
    function_call without functions or naming another function."""
    if body.functions is None:
        if body.function_call is not None:
            raise APIError(400, "function_call requires functions", param="function_call")
        return body
    if body.tools is not None or body.tool_choice is not None:
        raise APIError(400, "functions and tools can't be used together: send tools (functions is their "
                            "legacy form)", param="functions")
    choice = body.function_call
    if choice is not None and not isinstance(choice, str):
        if choice.name not in [function.name for function in body.functions]:
            raise APIError(400, f"function_call.name: {choice.name!r} is not among the functions",
                           param="function_call.name")
        choice = NamedToolChoice(type="function", function=choice)
    return body.model_copy(update={
        "tools": [Tool(type="function", function=function) for function in body.functions],
        "tool_choice": choice, "parallel_tool_calls": False, "functions": None, "function_call": None})


def in_function_terms(exc: APIError) -> APIError:
    """``exc`` naming the legacy fields the request sent (``functions.0.parameters``), not tools'."""
    return renamed(exc, _RENAMES)


def tool_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """``messages`` with legacy calls and results as tool calls and tool messages, one for one: an
    assistant's ``function_call`` becomes a call with the id ``call_<its message's index>``, and
    the next ``function`` message its result. 400 for a function_call beside tool_calls or outside
    an assistant message, or a function message without the function's name."""
    converted, pending = [], None
    for index, message in enumerate(messages):
        if message.function_call is not None:
            if message.role != "assistant" or message.tool_calls:
                raise APIError(400, f"messages.{index}.function_call: only an assistant message without "
                                    "tool_calls makes one", param=f"messages.{index}.function_call")
            pending = f"call_{index}"
            message = message.model_copy(update={
                "function_call": None, "tool_calls": [ToolCall(id=pending, function=message.function_call)]})
        elif message.role == "function":
            if not message.name:
                raise APIError(400, f"messages.{index}.name: a function message needs the name of its function",
                               param=f"messages.{index}.name")
            message = message.model_copy(update={"role": "tool", "tool_call_id": pending or f"call_{index}"})
            pending = None
        converted.append(message)
    return converted


def legacy_choice(choice: ChatChoice) -> ChatChoice:
    """An answer's choice in the legacy shape: its one call as ``message.function_call``."""
    message = choice.message
    if not message.tool_calls:
        return choice
    call = message.tool_calls[0].function
    return choice.model_copy(update={
        "message": message.model_copy(update={"tool_calls": None, "function_call": call}),
        "finish_reason": _legacy_reason(choice.finish_reason)})


def legacy_chunk_choice(choice: ChatChunkChoice) -> ChatChunkChoice:
    """A stream's choice in the legacy shape: the call's name, then its argument fragments, as
    ``delta.function_call``."""
    delta = choice.delta
    if delta.tool_calls:
        delta = delta.model_copy(update={"tool_calls": None, "function_call": delta.tool_calls[0].function})
    return choice.model_copy(update={"delta": delta, "finish_reason": _legacy_reason(choice.finish_reason)})


def _legacy_reason(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason
