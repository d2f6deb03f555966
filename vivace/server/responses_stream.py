"""The Responses API's server-sent events for one streamed answer: ``event: <type>`` and
``data: <json>`` frames, each numbered by ``sequence_number``, in OpenAI's order —
response.created, response.in_progress; per output item output_item.added, then for a reasoning
item (a thinking model's, with a reasoning parser; it comes first) content_part.added,
reasoning_text.delta and their .done events, for a message content_part.added, output_text.delta
(one per token event, as chat streams) and their .done events, for a function call
function_call_arguments.delta and .done; output_item.done; and response.completed (or
response.incomplete when cut off by max_output_tokens)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from vivace.engine.outputs import CompletionOutput, TokenLogprob
from vivace.server.errors import APIError
from vivace.server.generation import EngineRequest, timings_of, usage_with_thinking
from vivace.server.output_events import OutputEvents
from vivace.server.reasoning import Thinking
from vivace.server.responses import ChatTokenLogprob, Usage
from vivace.server.responses_objects import (
    FunctionToolCall, IncompleteDetails, ItemStatus, OutputMessage, OutputText, ReasoningItem, ReasoningText,
    ResponseObject, ResponseUsage)
from vivace.server.sse import sse_named
from vivace.server.tool_formats import HERMES, ToolFormat
from vivace.server.tool_parser import ToolCallDelta

Item = OutputMessage | FunctionToolCall | ReasoningItem
TextLogprobs = Callable[[list[TokenLogprob]], list[ChatTokenLogprob]]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseEvents(OutputEvents):
    """Writes the events of one answer as its thinking, text and tool calls arrive;
    ``answer.output`` holds the items so far, so the last event's response is the whole answer.
    ``logprobs`` writes a token event's logprobs as its text delta carries them (a plain text
    answer's: each token event is one delta)."""

    def __init__(self, answer: ResponseObject, calls: bool, thinking: Thinking | None = None,
                 tool_format: ToolFormat = HERMES, logprobs: TextLogprobs = lambda _: []) -> None:
        super().__init__(calls, thinking, tool_format)
        self.answer = answer
        self.sequence_number = 0
        self.open: Item | None = None
        self.logprobs = logprobs
        self.delta_logprobs: list[TokenLogprob] = []  # the logprobs of the token event being fed

    def feed(self, delta: CompletionOutput) -> list[str]:
        self.delta_logprobs = delta.logprobs or []
        return super().feed(delta)

    def event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return sse_named(kind, data)

    def lifecycle(self, kind: str) -> str:
        return self.event(kind, response=self.answer.model_dump(mode="json"))

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open.id, "output_index": len(self.answer.output) - 1}

    def _add(self, item: Item) -> list[str]:
        frames = self._close("completed")
        self.answer.output.append(item)
        self.open = item
        frames.append(self.event("response.output_item.added", output_index=len(self.answer.output) - 1,
                                 item=item.model_dump(mode="json")))
        if isinstance(item, (OutputMessage, ReasoningItem)):
            item.content.append(OutputText() if isinstance(item, OutputMessage) else ReasoningText())
            frames.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=item.content[0].model_dump(mode="json")))
        return frames

    def _close(self, status: ItemStatus) -> list[str]:
        item, frames = self.open, []
        if item is None:
            return frames
        where = self._where()
        item.status = status
        if isinstance(item, (OutputMessage, ReasoningItem)):
            part = item.content[0]
            done = (self.event("response.output_text.done", **where, content_index=0, text=part.text,
                               logprobs=[lp.model_dump(mode="json") for lp in part.logprobs])
                    if isinstance(item, OutputMessage) else
                    self.event("response.reasoning_text.done", **where, content_index=0, text=part.text))
            frames += [done, self.event("response.content_part.done", **where, content_index=0,
                                        part=part.model_dump(mode="json"))]
        else:
            frames.append(self.event("response.function_call_arguments.done", **where, arguments=item.arguments))
        frames.append(self.event("response.output_item.done", output_index=where["output_index"],
                                 item=item.model_dump(mode="json")))
        self.open = None
        return frames

    def start(self) -> list[str]:
        frames = [self.lifecycle("response.created"), self.lifecycle("response.in_progress")]
        if self.parser is None and self.splitter is None:  # plain text: the message opens at once, as OpenAI's does
            frames += self._add(OutputMessage(id=item_id("msg")))
        return frames

    def reasoning(self, text: str) -> list[str]:
        frames = [] if isinstance(self.open, ReasoningItem) else self._add(ReasoningItem(id=item_id("rs")))
        assert isinstance(self.open, ReasoningItem)
        self.open.content[0].text += text
        frames.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        return frames

    def text_open(self) -> bool:
        return isinstance(self.open, OutputMessage)

    def text(self, text: str) -> list[str]:
        frames = []
        if not isinstance(self.open, OutputMessage):
            frames += self._add(OutputMessage(id=item_id("msg")))
        assert isinstance(self.open, OutputMessage)
        logprobs, self.delta_logprobs = self.logprobs(self.delta_logprobs), []
        self.open.content[0].text += text
        self.open.content[0].logprobs += logprobs
        frames.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                 delta=text, logprobs=[lp.model_dump(mode="json") for lp in logprobs]))
        return frames

    def call(self, delta: ToolCallDelta) -> list[str]:
        frames = []
        if delta.id is not None:
            frames += self._add(FunctionToolCall(id=item_id("fc"), call_id=delta.id, name=delta.name or ""))
        assert isinstance(self.open, FunctionToolCall)
        if delta.arguments:
            self.open.arguments += delta.arguments
            frames.append(self.event("response.function_call_arguments.delta", **self._where(),
                                     delta=delta.arguments))
        return frames

    def finish(self, incomplete: bool) -> list[str]:
        """The last item closed (incomplete when cut off) and the answer's final event."""
        frames = []
        if not self.answer.output:
            frames += self._add(OutputMessage(id=item_id("msg")))
        return [*frames, *self._close("incomplete" if incomplete else "completed")]


def complete(answer: ResponseObject, job: EngineRequest, usage: Usage) -> None:
    """Fills in the finished ``job``'s status, ``usage`` and timings (its items are closed already)."""
    if job.choices[0].finish_reason == "length":
        answer.status, answer.incomplete_details = "incomplete", IncompleteDetails(reason="max_output_tokens")
    else:
        answer.status = "completed"
    answer.usage = ResponseUsage.of(usage)
    answer.timings = timings_of(job)


async def response_events(job: EngineRequest, answer: ResponseObject, calls: bool,
                          thinking: Thinking | None = None, tool_format: ToolFormat = HERMES,
                          logprobs: TextLogprobs = lambda _: []) -> AsyncGenerator[str, None]:
    """The stream of ``job``'s answer, which starts as ``answer`` (the request's settings); tool
    calls (written in ``tool_format``) are read out of it when ``calls``, its thinking with a
    reasoning parser (``thinking``); its text's logprobs written by ``logprobs``.
    An error after the first event ends the stream with an ``error`` event."""
    events = ResponseEvents(answer, calls, thinking, tool_format, logprobs)
    yield "".join(events.start())
    try:
        async with contextlib.aclosing(job.deltas()) as deltas:
            async for out in deltas:
                frames = [frame for delta in out.outputs for frame in events.feed(delta)]
                if frames:
                    yield "".join(frames)
    except APIError as exc:
        yield events.event("error", code=exc.code, message=exc.message, param=exc.param)
        return
    frames = events.finish(job.choices[0].finish_reason == "length")
    thought = events.splitter is not None and events.splitter.thought
    complete(answer, job, usage_with_thinking(job, thinking, [thought]))
    yield "".join([*frames, events.lifecycle(f"response.{answer.status}")])
