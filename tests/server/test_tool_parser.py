"""Reading Hermes-style tool calls out of streamed text, however the text is split."""

import json

import pytest

from vivace.server.tool_parser import ToolCallParser, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "tags": ["a}", "b\\""]}}\n</tool_call>'
ARGS = {"city": "Paris", "tags": ["a}", "b\""]}


def stream(text: str, size: int) -> tuple[str, dict[int, dict]]:
    """Feed ``text`` in pieces of ``size`` characters; assemble as an OpenAI client does."""
    parser, content, calls = ToolCallParser(), "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for piece in pieces:
        got, deltas = parser.feed(piece)
        content += got
        for delta in deltas:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:
                assert call["id"] is None and call["arguments"] == "", "id and name come first"
                call["id"], call["name"] = delta.id, delta.name
            call["arguments"] += delta.arguments
    content += parser.finish()[0]
    return content, calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_calls_assemble_whatever_the_split(size):
    text = "Let me check. " + CALL + "\n" + CALL.replace("Paris", "Rome")
    content, calls = stream(text, size)
    assert content == "Let me check. "
    assert [c["arguments"] for c in calls.values()] == [c.arguments for c in parse_tool_calls(text)[1]]
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_weather"]
    assert json.loads(calls[0]["arguments"]) == ARGS
    assert json.loads(calls[1]["arguments"])["city"] == "Rome"
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("size", [1, 4])
def test_text_that_only_looks_like_an_opener_is_content(size):
    content, calls = stream("a <tool maybe <tool_cal", size)
    assert content == "a <tool maybe <tool_cal" and not calls


def test_whole_output():
    content, calls = parse_tool_calls(CALL)
    assert content is None
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == ARGS
    content, calls = parse_tool_calls("Just text.")
    assert content == "Just text." and calls == []


def test_arguments_before_name_still_parse_at_the_end():
    content, calls = parse_tool_calls('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>')
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}


def test_a_call_cut_short_keeps_what_was_written():
    parser = ToolCallParser()
    _, deltas = parser.feed('<tool_call>\n{"name": "f", "arguments": {"x": "ab')
    assert deltas[0].name == "f" and deltas[-1].arguments.endswith('"ab')
    assert parser.finish() == ("", [])
    assert parser.calls[0].arguments == '{"x": "ab'


def test_a_next_call_cut_off_before_its_name_is_none():
    """max_tokens can end the output inside the next call's opener: that is no content."""
    for cut in range(len(CALL) + 1, len(CALL) + len("\n<tool_call>\n{\"name") + 1):
        text = (CALL + "\n" + CALL)[:cut]
        assert parse_tool_calls(text)[0] is None, text
        assert stream(text, 1)[0] == "", text
