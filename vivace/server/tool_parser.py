"""Reading tool calls out of the model's text as it streams: Hermes-style blocks
(:class:`ToolCallParser`) and the other families' forms (:class:`CallParser`, one
:class:`CallSyntax` each; ``vivace.server.tool_formats`` has them).

``feed`` takes each new piece of text and returns what the client may see now: plain content,
and tool-call deltas in OpenAI's streaming order (first the call's index, id and name with
empty arguments, then fragments of the arguments' JSON text). The arguments are the exact
text the model wrote for the ``"arguments"`` value, so the fragments join into valid JSON
once the call is complete (the grammar sees to that).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import regex

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# The grammar writes "name" first, then "arguments" (the schema's property order).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str | None = None
    arguments: str = ""


@dataclass
class _Scan:
    """Where the arguments' JSON value ends: depth of brackets outside strings."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False
    done: bool = False

    def take(self, text: str) -> int:
        """How many characters of ``text`` still belong to the value."""
        for i, char in enumerate(text):
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped = char == "\\"
                self.in_string = char != '"'
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


@dataclass
class ToolCallParser:
    """Splits one choice's streamed text into content and tool calls."""

    calls: list[ParsedCall] = field(default_factory=list)
    _pending: str = ""   # text not yet classified
    _in_call: bool = False
    _scan: _Scan | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content and tool-call deltas that ``text`` (the next piece of output) releases."""
        self._pending += text
        content, deltas = "", []
        while True:
            if not self._in_call:
                start = self._pending.find(CALL_OPEN)
                if start < 0:
                    keep = partial_suffix(self._pending, CALL_OPEN)
                    emit = self._pending[:len(self._pending) - keep]
                    content += emit if not self.calls else emit.strip()
                    self._pending = self._pending[len(emit):]
                    return content, deltas
                content += self._pending[:start] if not self.calls else ""
                self._pending = self._pending[start + len(CALL_OPEN):]
                self._in_call, self._scan = True, None
                self.calls.append(ParsedCall(f"call_{uuid.uuid4().hex[:24]}"))
            if not self._advance_call(deltas):
                return content, deltas

    def _advance_call(self, deltas: list[ToolCallDelta]) -> bool:
        """Consume what it can of the open call; True once the call has closed."""
        call, index = self.calls[-1], len(self.calls) - 1
        if self._scan is None:
            head = _HEAD.match(self._pending)
            if head is None:
                return self._close_unparsed(call, index, deltas)
            call.name = json.loads(head.group(1))
            deltas.append(ToolCallDelta(index, call.id, call.name, ""))
            self._pending, self._scan = self._pending[head.end():], _Scan()
        if not self._scan.started:  # whitespace before the value is no part of it
            self._pending = self._pending.lstrip()
            self._scan.started = bool(self._pending)
        if self._scan.started and not self._scan.done:
            taken = self._scan.take(self._pending)
            fragment, self._pending = self._pending[:taken], self._pending[taken:]
            if fragment:
                call.arguments += fragment
                deltas.append(ToolCallDelta(index, arguments=fragment))
        end = self._pending.find(CALL_CLOSE)
        if not self._scan.done or end < 0:
            return False
        self._pending, self._in_call = self._pending[end + len(CALL_CLOSE):], False
        return True

    def _close_unparsed(self, call: ParsedCall, index: int, deltas: list[ToolCallDelta]) -> bool:
        """A call whose head doesn't read as name-then-arguments: wait for its end, then take
        both from the whole object, in one delta (none if it names no function)."""
        end = self._pending.find(CALL_CLOSE)
        if end < 0:
            return False
        try:
            whole = json.loads(self._pending[:end])
            call.name, call.arguments = str(whole["name"]), json.dumps(whole["arguments"])
            deltas.append(ToolCallDelta(index, call.id, call.name, call.arguments))
        except (json.JSONDecodeError, KeyError, TypeError):
            call.arguments = self._pending[:end].strip()
        self._pending, self._in_call = self._pending[end + len(CALL_CLOSE):], False
        return True

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left once the output has ended: an opener's prefix was only text after all,
        unless it follows a call (then it is the next call, cut off before its name: none)."""
        rest, self._pending = self._pending, ""
        if self._in_call or (self.calls and CALL_OPEN.startswith(rest.strip())):
            return "", []
        return (rest if not self.calls else rest.strip()), []


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(text: str, parser: ToolCallParser | CallParser | None = None
                     ) -> tuple[str | None, list[ParsedCall]]:
    """The content (None if empty) and the calls of a whole output: those that name a function,
    as a stream of the same text through ``parser`` (default: Hermes-style) would give them (a
    call cut off before its name, e.g. by max_tokens, is none)."""
    parser = parser or ToolCallParser()
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    content = (content + rest).strip()
    return content or None, [call for call in parser.calls if call.name is not None]


@dataclass(frozen=True)
class CallSyntax:
    """One family's written calls, as regular expressions matched from where they begin:
    ``opener`` is the text that may begin the calls; ``first`` reads from it up to the first
    call's arguments value, ``next`` from the end of a call up to the next one's (both name the
    function in group ``name``, a JSON string, or ``bare``); ``tail`` reads from the end of the
    value to the end of its call, ``end`` what closes the calls."""

    opener: str
    first: str
    tail: str
    next: str
    end: str = ""

    def pattern(self, which: str) -> regex.Pattern[str]:
        return _compiled(getattr(self, which))


@functools.cache
def _compiled(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern)


class CallParser:
    """Splits one choice's streamed text into content and tool calls written in ``syntax``;
    ``new_id`` names each call. Text that begins like a call is held back until it is one (or
    can't be: then it is content, as written); text after the calls is content too."""

    def __init__(self, syntax: CallSyntax, new_id: Callable[[], str]) -> None:
        self.calls: list[ParsedCall] = []
        self._syntax, self._new_id = syntax, new_id
        self._pending = ""
        self._state = "text"  # text, first, value, tail, next, end
        self._scan = _Scan()
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content and tool-call deltas that ``text`` (the next piece of output) releases."""
        self._pending += text
        readers = {"text": self._read_text, "first": self._read_first, "value": self._read_value,
                   "tail": self._read_tail, "next": self._read_next, "end": self._read_end}
        while readers[self._state]():
            pass
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left once the output has ended: held text that never became a call is content;
        a call cut short keeps what it had, and the next one cut off before its name is none."""
        rest, self._pending = self._pending, ""
        if self._state in ("text", "first"):
            return rest, []
        return "", []

    def _emit(self, size: int) -> None:
        self._content.append(self._pending[:size])
        self._pending = self._pending[size:]

    def _read_text(self) -> bool:
        opener = self._syntax.opener
        start = self._pending.find(opener)
        if start < 0:
            self._emit(len(self._pending) - partial_suffix(self._pending, opener))
            return False
        self._emit(start)
        self._state = "first"
        return True

    def _match(self, which: str) -> regex.Match[str] | bool | None:
        """The whole match of ``which`` at the start of the held text; True while it may still
        come (the text so far is its beginning); None when it can't."""
        found = self._syntax.pattern(which).match(self._pending, partial=True)
        return True if found is not None and found.partial else found

    def _open_call(self, head: regex.Match[str]) -> None:
        bare = head.groupdict().get("bare")
        name = bare if bare is not None else json.loads(head["name"])
        self.calls.append(ParsedCall(self._new_id(), name))
        self._deltas.append(ToolCallDelta(len(self.calls) - 1, self.calls[-1].id, name, ""))
        self._pending, self._state, self._scan = self._pending[head.end():], "value", _Scan()

    def _read_first(self) -> bool:
        head = self._match("first")
        if head is True:
            return False
        if head is None:  # not a call after all: the opener is text
            self._emit(len(self._syntax.opener))
            self._state = "text"
            return True
        self._open_call(head)
        return True

    def _read_value(self) -> bool:
        taken = self._scan.take(self._pending)
        fragment, self._pending = self._pending[:taken], self._pending[taken:]
        if fragment:
            self.calls[-1].arguments += fragment
            self._deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=fragment))
        if self._scan.done:
            self._state = "tail"
        return self._scan.done

    def _read_tail(self) -> bool:
        tail = self._match("tail")
        if tail is True:
            return False
        self._pending = self._pending[tail.end():] if tail is not None else self._pending
        self._state = "next" if tail is not None else "text"
        return True

    def _read_next(self) -> bool:
        head = self._match("next")
        if head is True:
            return False
        if head is None:
            self._state = "end"
        else:
            self._open_call(head)
        return True

    def _read_end(self) -> bool:
        end = self._match("end")
        if end is True:
            return False
        if end is not None:
            self._pending = self._pending[end.end():]
        self._state = "text"
        return True
