"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API, answered
on chat completions' path (``vivace.server.chat.start_chat``): the same template, sampling, tool
calls, structured output, thinking, limits, admission, metrics and abort on disconnect. A
``max_tokens`` past the context is cut to the room left, as Anthropic's models stop at their
context window (stop_reason ``model_context_window_exceeded``); a prompt that leaves no room is
a 400 "prompt is too long". Errors are Anthropic's body (``vivace.server.errors``) and name the
Messages API's fields (``tools.0.input_schema``, ``thinking``), not chat's."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vivace.server.anthropic_objects import (
    Message, MessageUsage, TextContent, ThinkingContent, TokenCount, ToolUseContent, signature, tool_use_id)
from vivace.server.anthropic_protocol import MessagesPrompt, MessagesRequest
from vivace.server.anthropic_stream import MessageEvents, complete, error_frame, input_object, message_events
from vivace.server.chat import StartedChat, render_chat, start_chat
from vivace.server.errors import APIError, renamed
from vivace.server.generation import run_whole, submitted
from vivace.server.prompts import parse_body
from vivace.server.sse import sse_response
from vivace.server.state import server_state

_BLOCKS = "text|tool_use|tool_result|thinking|redacted_thinking"
# Chat's names (and pydantic's union tags) for the Messages API's fields.
_RENAMES = [
    (re.compile(r"^messages\.(\d+)\.(?:user|assistant)(?=\.|$)"), r"messages.\1"),
    (re.compile(rf"\.content\.(\d+)\.(?:{_BLOCKS})(?=\.|$)"), r".content.\1"),
    (re.compile(r"^(tool_choice|thinking)\.(?:auto|any|tool|none|enabled|adaptive|disabled)(?=\.|$)"), r"\1"),
    (re.compile(r"^tools\.(\d+)\.function\.parameters"), r"tools.\1.input_schema"),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^response_format(\..*)?$"), "output_config.format"),
    (re.compile(r"^max_(?:completion_)?tokens$"), "max_tokens"),
    (re.compile(r"^reasoning_effort$"), "thinking"),
    (re.compile(r"^stop$"), "stop_sequences"),
]


async def create_message(request: Request) -> Response:
    """Anthropic's Messages API; see ``vivace.server.anthropic_protocol.MessagesRequest``."""
    state = server_state(request)
    try:
        body = await parse_body(request, MessagesRequest, state.metrics.work["parse"])
        chat = await start_chat(request, body.chat_request(), "msg_", clamp=True)
    except APIError as exc:
        raise renamed(exc, _RENAMES) from None
    job = chat.job
    message = Message(id=job.request_id, model=state.model_name(body.model),
                      usage=MessageUsage(input_tokens=len(job.prompt_ids), output_tokens=0))
    clamped = job.params.max_tokens < body.max_tokens
    if body.stream:
        events = MessageEvents(message, chat.calls, chat.thinking, chat.tool_format, body.show_thinking())
        on_close = submitted([job], chat.ticket.release)
        return sse_response(message_events(job, events, clamped), on_close,
                            state.metrics.work["sse_write"], end="", error_frame=error_frame)
    if not await run_whole(request, job, chat.ticket.release):
        return Response(status_code=499)
    thought = _content(message, chat, body.show_thinking())
    complete(message, job, chat.thinking, thought, clamped)
    return JSONResponse(message.model_dump(mode="json"))


async def count_message_tokens(request: Request) -> Response:
    """The prompt's tokens, as ``/v1/messages`` renders the same conversation, tools and thinking."""
    state = server_state(request)
    try:
        body = await parse_body(request, MessagesPrompt, state.metrics.work["parse"])
        prompt = await render_chat(state, state.engine_for(body.model, state.caller(request)), body.chat_request())
    except APIError as exc:
        raise renamed(exc, _RENAMES) from None
    return JSONResponse(TokenCount(input_tokens=len(prompt.prompt_ids)).model_dump())


def _content(message: Message, chat: StartedChat, show_thinking: bool) -> bool:
    """The finished request's content blocks: its thinking (with a reasoning parser), its text,
    then its tool calls (an empty text block when there is nothing). Returns whether the output
    had a think block."""
    split, parsed = chat.whole_answer()
    if split.reasoning is not None:
        message.content.append(ThinkingContent(thinking=split.reasoning if show_thinking else "",
                                               signature=signature(split.reasoning)))
    if split.content:
        message.content.append(TextContent(text=split.content))
    message.content += [ToolUseContent(id=tool_use_id(), name=call.name or "", input=input_object(call.arguments))
                        for call in parsed]
    if not message.content:
        message.content.append(TextContent())
    return split.thought
