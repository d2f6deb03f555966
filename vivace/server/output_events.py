"""Reading one streamed answer for the APIs that stream it as typed pieces (the Responses API's
items, the Messages API's content blocks): each token event's output is split into thinking (with
a reasoning parser), text and tool-call deltas (when calls may come), and each piece is handed
to the subclass, which writes its API's events."""

from __future__ import annotations

from vivace.engine.outputs import CompletionOutput
from vivace.server.reasoning import Thinking
from vivace.server.tool_formats import HERMES, ToolFormat
from vivace.server.tool_parser import ToolCallDelta


class OutputEvents:
    """The events of one answer, as its pieces arrive. Text around tool calls is trimmed as the
    whole answer's content is (``vivace.server.tool_parser.parse_tool_calls``)."""

    def __init__(self, calls: bool, thinking: Thinking | None = None, tool_format: ToolFormat = HERMES) -> None:
        self.splitter = thinking.splitter() if thinking is not None else None
        self.parser = tool_format.parser() if calls else None
        self.held = ""  # trailing whitespace of the text so far (tool calls may follow)

    def reasoning(self, text: str) -> list[str]:
        """The events of more thinking."""
        raise NotImplementedError

    def text(self, text: str) -> list[str]:
        """The events of more answer text ("" too, for a token that adds none yet, when the output
        is plain text: one event per token, as chat streams)."""
        raise NotImplementedError

    def call(self, delta: ToolCallDelta) -> list[str]:
        """The events of a tool call's start (``delta.id`` set) or of more of its arguments."""
        raise NotImplementedError

    def text_open(self) -> bool:
        """Whether answer text is being written (more text continues it)."""
        raise NotImplementedError

    def feed(self, delta: CompletionOutput) -> list[str]:
        """The events of one token event's output."""
        finished, text, frames = delta.finish_reason is not None, delta.text, []
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text, final=finished)
            frames += self.reasoning(reasoning) if reasoning else []
        if self.parser is None:
            plain = self.splitter is None and delta.token_ids
            return frames + (self.text(text) if text or plain else [])
        text, calls = self.parser.feed(text)
        if finished:
            text += self.parser.finish()[0]
        text = self._trimmed(text) if text else ""
        frames += self.text(text) if text else []
        for call in calls:
            if call.id is not None:
                self.held = ""
            frames += self.call(call)
        return frames

    def _trimmed(self, text: str) -> str:
        """``text`` as the whole answer's content has it: trailing whitespace held back until more
        text follows, a new text part's leading whitespace dropped."""
        text = self.held + text
        if not self.text_open():
            text = text.lstrip()
        kept = text.rstrip()
        self.held = text[len(kept):]
        return kept
