"""Anthropic's server-sent events for one streamed answer (``event: <type>`` and ``data: <json>``
frames), in Anthropic's order: message_start (the message without content, once the engine's
first output tells how much of the prompt the prefix cache held); per content block
content_block_start, its deltas and content_block_stop — a thinking block's thinking_delta
events (with a reasoning parser; it comes first) then one signature_delta, a text block's
text_delta events (one per token event when the output is plain text, as chat streams), a
tool_use block's input as input_json_delta fragments; then message_delta (stop_reason,
stop_sequence and the usage's cumulative counts) and message_stop. An error after the first
event ends the stream with an ``error`` event (:func:`error_frame`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

from vivace.server.anthropic_objects import (
    ContentBlock, Message, MessageUsage, StopReason, TextContent, ThinkingContent, ToolUseContent, signature,
    tool_use_id)
from vivace.server.errors import APIError
from vivace.server.generation import EngineRequest, timings_of, usage_with_thinking
from vivace.server.output_events import OutputEvents
from vivace.server.reasoning import Thinking
from vivace.server.sse import sse_named
from vivace.server.tool_formats import ToolFormat
from vivace.server.tool_parser import ToolCallDelta


def error_frame(exc: APIError) -> str:
    """The ``error`` event that ends a stream: Anthropic's error body."""
    return sse_named("error", exc.anthropic_body())


def input_object(arguments: str) -> dict[str, Any]:
    """A tool call's input from the JSON text the model wrote; {} for a call cut off before its
    input was whole (the answer's stop_reason is then max_tokens)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_of(job: EngineRequest, called: bool, clamped: bool) -> tuple[StopReason | None, str | None]:
    """The finished ``job``'s stop_reason and the stop sequence that ended it. ``clamped``: its
    max_tokens was cut to the room the context had, so running out of it is the context's end."""
    choice = job.choices[0]
    if choice.finish_reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if choice.finish_reason != "stop":
        return None, None
    if called:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def complete(message: Message, job: EngineRequest, thinking: Thinking | None, thought: bool, clamped: bool) -> None:
    """Fills in the finished ``job``'s stop reason, usage and timings (``thought``: whether the
    output had a think block)."""
    called = any(isinstance(block, ToolUseContent) for block in message.content)
    message.stop_reason, message.stop_sequence = stop_of(job, called, clamped)
    message.usage = MessageUsage.of(usage_with_thinking(job, thinking, [thought]))
    message.timings = timings_of(job)


class MessageEvents(OutputEvents):
    """Writes the events of one answer as its thinking, text and tool calls arrive;
    ``message.content`` holds the blocks so far. With ``show_thinking`` False (``display:
    "omitted"``) a thinking block carries its signature only."""

    def __init__(self, message: Message, calls: bool, thinking: Thinking | None, tool_format: ToolFormat,
                 show_thinking: bool = True) -> None:
        super().__init__(calls, thinking, tool_format)
        self.message = message
        self.thinking = thinking
        self.show_thinking = show_thinking
        self.open = False  # whether the last block is still being written
        self.arguments = ""  # the open tool_use block's input, as JSON text so far

    @staticmethod
    def event(kind: str, **payload: Any) -> str:
        return sse_named(kind, {"type": kind, **payload})

    def _delta(self, delta: dict[str, str]) -> str:
        return self.event("content_block_delta", index=len(self.message.content) - 1, delta=delta)

    def _last(self) -> ContentBlock | None:
        return self.message.content[-1] if self.open else None

    def _add(self, block: ContentBlock) -> list[str]:
        frames = self._close()
        self.message.content.append(block)
        self.open = True
        return [*frames, self.event("content_block_start", index=len(self.message.content) - 1,
                                    content_block=block.model_dump(mode="json"))]

    def _close(self) -> list[str]:
        block, frames = self._last(), []
        if block is None:
            return frames
        if isinstance(block, ThinkingContent):
            block.signature = signature(block.thinking)
            frames.append(self._delta({"type": "signature_delta", "signature": block.signature}))
            if not self.show_thinking:
                block.thinking = ""
        elif isinstance(block, ToolUseContent):
            block.input = input_object(self.arguments)
        self.open = False
        return [*frames, self.event("content_block_stop", index=len(self.message.content) - 1)]

    def start(self) -> list[str]:
        """message_start (``message.usage`` as the prompt stands), and a plain-text answer's block."""
        frames = [self.event("message_start", message=self.message.model_dump(mode="json"))]
        if self.parser is None and self.splitter is None:
            frames += self._add(TextContent())
        return frames

    def reasoning(self, text: str) -> list[str]:
        block = self._last()
        frames = [] if isinstance(block, ThinkingContent) else self._add(block := ThinkingContent())
        block.thinking += text
        if self.show_thinking:
            frames.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return frames

    def text_open(self) -> bool:
        return isinstance(self._last(), TextContent)

    def text(self, text: str) -> list[str]:
        block = self._last()
        frames = [] if isinstance(block, TextContent) else self._add(block := TextContent())
        block.text += text
        return [*frames, self._delta({"type": "text_delta", "text": text})]

    def call(self, delta: ToolCallDelta) -> list[str]:
        frames = []
        if delta.id is not None:
            frames += self._add(ToolUseContent(id=tool_use_id(), name=delta.name or ""))
            self.arguments = ""
        if delta.arguments:
            self.arguments += delta.arguments
            frames.append(self._delta({"type": "input_json_delta", "partial_json": delta.arguments}))
        return frames

    def finish(self, job: EngineRequest, clamped: bool) -> list[str]:
        """The last block closed (an empty text block when the answer had none), then
        message_delta and message_stop."""
        frames = [] if self.message.content else self._add(TextContent())
        frames += self._close()
        thought = self.splitter is not None and self.splitter.thought
        complete(self.message, job, self.thinking, thought, clamped)
        usage = self.message.usage.model_dump(mode="json")
        return [*frames, self.event("message_delta", usage=usage, delta={
                    "stop_reason": self.message.stop_reason, "stop_sequence": self.message.stop_sequence}),
                self.event("message_stop")]


async def message_events(job: EngineRequest, events: MessageEvents, clamped: bool) -> AsyncGenerator[str, None]:
    """The stream of ``job``'s answer, written by ``events`` (its message the request's id and
    model). ``clamped``: see :func:`stop_of`."""
    started = False
    async with contextlib.aclosing(job.deltas()) as deltas:
        async for out in deltas:
            frames = []
            if not started:
                started = True
                events.message.usage = MessageUsage(input_tokens=len(job.prompt_ids) - out.num_cached_tokens,
                                                    cache_read_input_tokens=out.num_cached_tokens, output_tokens=0)
                frames += events.start()
            frames += [frame for delta in out.outputs for frame in events.feed(delta)]
            if frames:
                yield "".join(frames)
    yield "".join(events.finish(job, clamped))
