"""``--reasoning-parser``: a thinking model's ``<think>`` text handed out apart from its answer, in
chat completions (whole and streamed, n choices, tool calls, structured output, cut mid-thought)
and the Responses API (a reasoning item, its events, reasoning tokens). The model is a real one
that thinks on cue (``tests/server/thinker.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from vivace.cli import main
from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine
from vivace.engine.outputs import CompletionOutput, FinishReason
from vivace.server import ServerSettings
from vivace.server.reasoning import THINK_CLOSE, ReasoningParser
from vivace.server.responses_objects import ResponseObject
from vivace.server.responses_stream import ResponseEvents
from vivace.server.state import ServerState

from .harness import RunningServer, assert_engine_idle, serving_own_engine
from .thinker import ANSWER, THOUGHT, THOUGHT_TOKENS, save_thinker

TAG_STARTS = tuple(THINK_CLOSE[:size] for size in range(1, len(THINK_CLOSE)))
ASK = [{"role": "user", "content": "Capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    return save_thinker(tmp_path_factory.mktemp("thinker"), default_tokenizer_dir)


@pytest.fixture(scope="module")
def thinker(thinker_dir: Path) -> Iterator[RunningServer]:
    config = EngineConfig(model=str(thinker_dir), max_model_len=512, num_kv_blocks=96, max_num_seqs=8)
    with serving_own_engine(config, ServerSettings(served_model_name="thinker", reasoning_parser="qwen3")) as running:
        yield running


@pytest.fixture
def server(thinker: RunningServer) -> Iterator[RunningServer]:
    yield thinker
    assert_engine_idle(thinker.engine)


def _chat(server: RunningServer, **kwargs: object):
    return server.client().chat.completions.create(
        model="thinker", messages=kwargs.pop("messages", ASK), temperature=0, **kwargs)


def _stream(server: RunningServer, **kwargs: object) -> dict[int, dict[str, object]]:
    """Per choice: its reasoning and content deltas, finish reason; and the usage."""
    choices: dict[int, dict[str, object]] = {}
    usage = None
    for chunk in _chat(server, stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            seen = choices.setdefault(choice.index, {"reasoning": [], "content": [], "finish": None})
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")  # both names, the same text
            if extra.get("reasoning"):
                seen["reasoning"].append(extra["reasoning"])
            if choice.delta.content:
                seen["content"].append(choice.delta.content)
            seen["finish"] = choice.finish_reason or seen["finish"]
    choices[-1] = {"usage": usage}
    return choices


def test_whole_answer_splits_thinking_from_content_and_counts_its_tokens(server: RunningServer) -> None:
    response = _chat(server, logprobs=True)
    (choice,) = response.choices
    message = choice.message
    assert message.content == ANSWER and choice.finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == THOUGHT
    assert response.usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    # logprobs cover every generated token, the thinking's first
    tokens = [lp.token for lp in choice.logprobs.content]
    assert len(tokens) == response.usage.completion_tokens and tokens[0] == "<think>"


def test_stream_hands_out_thinking_then_content_and_never_a_tag(server: RunningServer) -> None:
    choices = _stream(server)
    seen = choices[0]
    assert "".join(seen["reasoning"]) == THOUGHT and "".join(seen["content"]) == ANSWER
    assert len(seen["reasoning"]) > 1 and seen["finish"] == "stop"
    assert not any("think>" in piece for piece in seen["reasoning"] + seen["content"])
    assert choices[-1]["usage"].completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS


def test_a_tag_cut_across_stream_chunks_is_never_handed_out_in_pieces(server: RunningServer) -> None:
    """A stop string that might begin with ">" holds the closing tag's ">" back a token: the
    engine sends "...</think" and ">\\n\\n" apart."""
    seen = _stream(server, stop=[">>"])[0]
    reasoning, content = seen["reasoning"], seen["content"]
    assert "".join(reasoning) == THOUGHT and content == [ANSWER]  # the tag's ">" went with it
    assert not any(piece.endswith(TAG_STARTS) or "think" in piece for piece in reasoning), reasoning


def test_a_block_the_prompt_opened_starts_the_output_inside_it(server: RunningServer) -> None:
    extra = {"chat_template_kwargs": {"open_thinking": True}}
    message = _chat(server, extra_body=extra).choices[0].message
    assert message.model_extra["reasoning"] == THOUGHT and message.content == ANSWER
    choices = _stream(server, extra_body=extra)
    assert "".join(choices[0]["reasoning"]) == THOUGHT and "".join(choices[0]["content"]) == ANSWER


def test_no_think_block_is_plain_content(server: RunningServer) -> None:
    for kwargs in ({"cue": "Hello"}, {"enable_thinking": False}):
        response = _chat(server, extra_body={"chat_template_kwargs": kwargs})
        message = response.choices[0].message
        assert "reasoning" not in (message.model_extra or {})
        assert message.content == (" world" if "cue" in kwargs else ANSWER)
        assert response.usage.completion_tokens_details.reasoning_tokens == 0
    choices = _stream(server, extra_body={"chat_template_kwargs": {"cue": "Hello"}})
    assert choices[0]["reasoning"] == [] and "".join(choices[0]["content"]) == " world"


def test_reasoning_effort_none_turns_qwen3_thinking_off(server: RunningServer) -> None:
    off = _chat(server, reasoning_effort="none")
    assert "reasoning" not in (off.choices[0].message.model_extra or {}) and off.choices[0].message.content == ANSWER
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    on = _chat(server, reasoning_effort="low")  # any other effort: the model thinks as long as it does
    assert on.choices[0].message.model_extra["reasoning"] == THOUGHT
    # the request's own template variables win over the effort's
    kept = _chat(server, reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert kept.choices[0].message.model_extra["reasoning"] == THOUGHT


def test_a_call_after_the_thinking_is_a_call_and_one_inside_it_is_not(server: RunningServer) -> None:
    """"required": the grammar leaves the thinking (which writes <tool_call>) free and forces the
    call after it; "auto": the thinking's <tool_call> is neither a call nor opens the grammar's."""
    required = _chat(server, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] == THOUGHT
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {}
    auto = _chat(server, tools=[WEATHER]).choices[0]
    assert auto.message.content == ANSWER and not auto.message.tool_calls and auto.finish_reason == "stop"
    assert auto.message.model_extra["reasoning"] == THOUGHT
    streamed = _stream(server, tools=[WEATHER])
    assert "".join(streamed[0]["reasoning"]) == THOUGHT and "".join(streamed[0]["content"]) == ANSWER


def test_structured_output_applies_after_the_thinking(server: RunningServer) -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
              "additionalProperties": False}
    message = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
                    ).choices[0].message
    assert message.model_extra["reasoning"] == THOUGHT and json.loads(message.content) == {"city": "Paris"}
    # with tools, "auto": after the free thinking, the schema's answer or a call (the model wants "Paris")
    choice = _chat(server, tools=[WEATHER], max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}).choices[0]
    assert choice.message.model_extra["reasoning"] == THOUGHT
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    else:
        assert choice.finish_reason == "stop" and json.loads(choice.message.content) == {"city": "Paris"}


def test_a_thought_cut_by_max_tokens_has_no_content(server: RunningServer) -> None:
    response = _chat(server, max_tokens=4)
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] == "Use <tool"
    assert response.usage.completion_tokens_details.reasoning_tokens == 4
    streamed = _stream(server, max_tokens=4)
    assert "".join(streamed[0]["reasoning"]) == "Use <tool" and streamed[0]["content"] == []
    assert streamed[0]["finish"] == "length"


def test_each_of_n_choices_is_split_on_its_own(server: RunningServer) -> None:
    response = _chat(server, n=2)
    assert [(c.message.model_extra["reasoning"], c.message.content) for c in response.choices] == [(THOUGHT, ANSWER)] * 2
    assert response.usage.completion_tokens_details.reasoning_tokens == 2 * THOUGHT_TOKENS
    streamed = _stream(server, n=2)
    assert [("".join(streamed[i]["reasoning"]), "".join(streamed[i]["content"])) for i in (0, 1)] == \
        [(THOUGHT, ANSWER)] * 2


def test_an_answer_sent_back_keeps_its_thinking_for_the_template(server: RunningServer) -> None:
    answer = _chat(server).choices[0].message.model_dump(exclude_none=True)  # both names, as the client keeps them
    history = [*ASK, answer, {"role": "user", "content": "And of Italy?"}]
    with server.http() as http:
        ids = http.post("/tokenize", json={"messages": history}).json()["tokens"]
        refused = http.post("/tokenize", json={"messages": [{**ASK[0], "reasoning_content": "hm"}]})
    assert ids.count(server.engine.tokenizer.convert_tokens_to_ids("<think>")) == 1
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.0.reasoning_content"
    assert _chat(server, messages=history).choices[0].message.content == ANSWER


def test_responses_api_gives_a_reasoning_item_before_the_message(server: RunningServer) -> None:
    client = server.client()
    response = client.responses.create(model="thinker", input="Capital of France?", temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT and reasoning.summary == []
    assert message.type == "message" and response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    with client.responses.stream(model="thinker", input="Capital of France?", temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert final.output[0].content[0].text == THOUGHT
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # sent back, the reasoning item is the thinking of its turn; effort "none" turns thinking off
    again = client.responses.create(model="thinker", temperature=0, reasoning={"effort": "none"}, input=[
        {"role": "user", "content": "Capital of France?"}, *[item.model_dump(exclude_none=True) for item in final.output],
        {"role": "user", "content": "Sure?"}])
    assert [item.type for item in again.output] == ["message"] and again.output_text == ANSWER
    assert again.usage.output_tokens_details.reasoning_tokens == 0


def test_responses_api_thought_cut_short_is_an_incomplete_reasoning_item(server: RunningServer) -> None:
    response = server.client().responses.create(model="thinker", input="hi", temperature=0, max_output_tokens=4)
    (reasoning,) = response.output
    assert response.status == "incomplete" and reasoning.status == "incomplete"
    assert reasoning.content[0].text == "Use <tool"


def test_responses_api_output_logprobs_are_refused_with_a_reasoning_parser(server: RunningServer) -> None:
    """They would mix the thinking's tokens with the answer's: a 400 naming include."""
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().responses.create(model="thinker", input="hi", max_output_tokens=4,
                                         include=["message.output_text.logprobs"])
    assert refused.value.body["param"] == "include", refused.value.body


def test_streamed_response_events_whatever_the_split() -> None:
    """The events of an answer fed in pieces of every size assemble the same items."""
    thinking = ReasoningParser("qwen3", 1, 2).thinking([5, 6])
    text = "<think>\nI think\n</think>\n\nParis"
    for size in range(1, len(text) + 1):
        answer = ResponseObject(id="resp-1", model="m", instructions=None, max_output_tokens=None, temperature=1.0,
                                top_p=1.0, parallel_tool_calls=True, tool_choice="auto", tools=[], text={},
                                reasoning=None, metadata={}, store=False, user=None)
        events = ResponseEvents(answer, calls=False, thinking=thinking)
        frames = events.start()
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            frames += events.feed(CompletionOutput(0, piece, [i], None, FinishReason.STOP if i == len(pieces) - 1
                                                   else None))
        frames += events.finish(incomplete=False)
        assert [item.type for item in answer.output] == ["reasoning", "message"]
        assert answer.output[0].content[0].text == "I think" and answer.output[1].content[0].text == "Paris"
        assert all(item.status == "completed" for item in answer.output)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_splitter_gives_the_same_split_whatever_the_chunks(size: int) -> None:
    parser = ReasoningParser("qwen3", 1, 2)
    for opened, text, expected in [
            (False, "  <think>\n a </think>  b</think>\n\nc ", ("a", "b</think>\n\nc ")),
            (False, "<thinking> is a tag", (None, "<thinking> is a tag")),
            (False, "<think>cut mid-thought </th", ("cut mid-thought </th", None)),
            (True, "<think>again</think>x", ("again", "x")),
            (True, "no close", ("no close", None)),
            (True, "</think>\n\nonly content", (None, "only content"))]:
        thinking = parser.thinking([1] if opened else [])
        whole = thinking.split(text)
        assert (whole.reasoning, whole.content) == expected
        splitter, reasoning, content = thinking.splitter(), "", ""
        for i in range(0, len(text), size):
            more = splitter.feed(text[i:i + size])
            assert not more[0].endswith(TAG_STARTS), more  # a possible tag waits for what follows
            reasoning, content = reasoning + more[0], content + more[1]
        rest = splitter.feed("", final=True)
        assert (reasoning + rest[0] or None, content + rest[1]) == (expected[0], expected[1] or "")


def test_where_the_output_begins_is_read_off_the_prompt() -> None:
    qwen3, r1 = ReasoningParser("qwen3", 1, 2), ReasoningParser("deepseek_r1", 1, 2)
    assert qwen3.thinking([7, 1, 8]).opened and r1.thinking([7, 1, 8]).opened  # the prompt opened a block
    assert not qwen3.thinking([7, 1, 2, 8]).opened and not r1.thinking([1, 2, 8]).opened  # closed (no thinking)
    assert not qwen3.thinking([7, 8]).opened  # qwen3: the model opens one itself, or answers
    assert r1.thinking([7, 8]).opened  # deepseek_r1: thinking from the first token, tag or none


def test_a_tokenizer_without_think_tokens_is_refused(tiny_engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="no <think> token"):
        ServerState(ServerSettings(reasoning_parser="deepseek_r1"), tiny_engine)


def test_an_unknown_parser_exits_2_at_start(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["serve", "--reasoning-parser", "granite", "--port", "1"]) == 2
    assert "unknown reasoning parser 'granite'" in capsys.readouterr().err
    monkeypatch.setenv("VIVACE_REASONING_PARSER", "nope")
    assert main(["serve", "--port", "1"]) == 2
    assert "choose one of deepseek_r1, qwen3" in capsys.readouterr().err

