"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` through the official anthropic client:
plain, system and prefilled conversations (each the chat completion of the same conversation),
stop sequences, max_tokens, the stream helper's message equal to the whole answer, tool use and
its round trip, thinking blocks (a model that thinks on cue), token counts, Anthropic's error
bodies (keys by x-api-key or bearer), and a stream abandoned mid-answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import jsonschema
import pytest
from anthropic.types import Message

from vivace.config import EngineConfig
from vivace.server import ServerSettings

from .harness import RunningServer, assert_engine_idle, serving, serving_own_engine
from .test_cancellation import aborted, assert_aborted_and_idle
from .thinker import ANSWER, THOUGHT, THOUGHT_TOKENS, save_thinker

KEY = "sk-anthropic-test"
CITY = {"$schema": "http://json-schema.org/draft-07/schema#",  # as Claude Code writes its tools
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def server(tools_server: RunningServer) -> RunningServer:
    return tools_server


@pytest.fixture(scope="module")
def keyed(tools_server_module: RunningServer) -> Iterator[RunningServer]:
    """The same engine behind a server with an API key, a small body limit and a 1 s request timeout."""
    settings = ServerSettings(served_model_name="tiny", api_keys=(KEY,), max_body_bytes=4096, request_timeout_s=1.0)
    with serving(tools_server_module.engine, settings) as running:
        yield running


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Iterator[RunningServer]:
    model = save_thinker(tmp_path_factory.mktemp("thinker"), default_tokenizer_dir)
    config = EngineConfig(model=str(model), max_model_len=512, num_kv_blocks=64, max_num_seqs=4)
    with serving_own_engine(config, ServerSettings(served_model_name="thinker", reasoning_parser="qwen3")) as running:
        yield running
        assert_engine_idle(running.engine)


def _client(server: RunningServer, **kwargs: object) -> anthropic.Anthropic:
    kwargs.setdefault("api_key", "none")
    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=60, **kwargs)


def _parsed(message: Message) -> Message:
    """The answer re-validated strictly by the client's own type (the client itself is lenient)."""
    return Message.model_validate(message.model_dump(mode="json", exclude_unset=True))


def _greedy(**extra: object) -> dict[str, object]:
    """``extra_body`` of a greedy request: the client has no sampling arguments; the API takes them."""
    return {"temperature": 0, **extra}


def _create(server: RunningServer, **kwargs: object) -> Message:
    kwargs.setdefault("messages", ASK)
    kwargs["extra_body"] = _greedy(**kwargs.get("extra_body", {}))
    return _parsed(_client(server).messages.create(model="tiny", **kwargs))


def test_plain_message(server: RunningServer) -> None:
    message = _create(server, max_tokens=4, metadata={"user_id": "u-1"}, service_tier="auto")
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > 0 and 0 < usage.output_tokens <= 4
    assert usage.cache_creation_input_tokens == 0


def test_system_and_prefill_are_the_chat_conversation(server: RunningServer) -> None:
    chat = server.client().chat.completions.create(
        model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "You are a bot.\n\nAnswer briefly."}, *ASK])
    for system in ("You are a bot.\n\nAnswer briefly.",
                   [{"type": "text", "text": "You are a bot.", "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "Answer briefly."}],
                   # Claude Code's billing header, whose hash changes per request, is not the model's to read
                   [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=4f1a2;"},
                    {"type": "text", "text": "You are a bot.\n\nAnswer briefly."}],
                   "x-anthropic-billing-header: cc_version=2.1.3; cch=90b1e;\nYou are a bot.\n\nAnswer briefly."):
        message = _create(server, max_tokens=6, system=system, extra_body={"ignore_eos": True})
        assert message.content[0].text == chat.choices[0].message.content
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    prefill = [*ASK, {"role": "assistant", "content": "It is"}]
    continued = server.client().chat.completions.create(
        model="tiny", messages=prefill, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    message = _create(server, messages=prefill, max_tokens=5, extra_body={"ignore_eos": True})
    assert message.content[0].text == continued.choices[0].message.content


def test_stop_sequence_and_max_tokens(server: RunningServer) -> None:
    common = dict(max_tokens=12, extra_body={"ignore_eos": True})
    whole = _create(server, **common)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    text = whole.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"no usable stop sequence in {text!r}"
    stopped = _create(server, stop_sequences=["never there", stop], **common)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[:text.index(stop)]


def test_max_tokens_past_the_context_stop_at_its_end(server: RunningServer) -> None:
    messages = [{"role": "user", "content": "x " * 990}]
    prompt = _client(server).messages.count_tokens(model="tiny", messages=messages).input_tokens
    room = 1024 - prompt  # the server's context
    assert 0 < room < 40, prompt
    message = _create(server, messages=messages, max_tokens=room + 100, extra_body={"ignore_eos": True})
    assert message.stop_reason == "model_context_window_exceeded" and message.usage.output_tokens == room


def test_stream_helper_assembles_the_greedy_answer(server: RunningServer) -> None:
    args = dict(model="tiny", max_tokens=8, messages=ASK, extra_body=_greedy(ignore_eos=True))
    client = _client(server)
    whole = _parsed(client.messages.create(**args))
    with client.messages.stream(**args) as stream:
        texts = list(stream.text_stream)
        final = _parsed(stream.get_final_message())
    assert len(texts) == 8  # one text delta per token, as chat streams
    assert final.content == whole.content and "".join(texts) == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens)
    kinds = [event.type for event in client.messages.create(**args, stream=True)]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * 8, "content_block_stop",
                     "message_delta", "message_stop"]
    body = {**{key: value for key, value in args.items() if key != "extra_body"}, **_greedy(ignore_eos=True),
            "stream": True}
    with server.http() as http, http.stream("POST", "/v1/messages", json=body) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        frames = raw.read().decode().strip().split("\n\n")
    for frame in frames:
        event, data = frame.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]


def test_tool_use_and_its_round_trip(server: RunningServer) -> None:
    client = _client(server)
    args = dict(model="tiny", max_tokens=60, messages=ASK, tools=[WEATHER], extra_body=_greedy(),
                tool_choice={"type": "any", "disable_parallel_tool_use": True})
    message = _parsed(client.messages.create(**args))
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, CITY)
    with client.messages.stream(**args) as stream:
        partial = [event.partial_json for event in stream if event.type == "input_json"]
        streamed = _parsed(stream.get_final_message())
    (streamed_call,) = [block for block in streamed.content if block.type == "tool_use"]
    assert json.loads("".join(partial)) == streamed_call.input == call.input
    assert streamed.stop_reason == "tool_use"
    named = _parsed(client.messages.create(**{**args, "tool_choice": {"type": "tool", "name": "get_weather"}}))
    assert [block.name for block in named.content if block.type == "tool_use"] == ["get_weather"]
    turn = [*ASK, {"role": "assistant", "content": message.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                                         {"type": "text", "text": "Thanks!"}]}]
    answer = _parsed(client.messages.create(**{**args, "messages": turn, "tool_choice": {"type": "auto"},
                                               "max_tokens": 5}))
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The turn is chat's: the assistant's call, then a tool message and a user message.
    count = client.messages.count_tokens(model="tiny", messages=turn, tools=[WEATHER])
    chat_call = {"id": call.id, "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}
    chat_turn = [*ASK, {"role": "assistant", "content": "", "tool_calls": [chat_call]},
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
                 {"role": "user", "content": "Thanks!"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": CITY}}]
    with server.http() as http:
        tokenized = http.post("/tokenize", json={"model": "tiny", "messages": chat_turn, "tools": tools}).json()
    assert count.input_tokens == tokenized["count"]


def test_a_streamed_tool_call_as_the_vercel_ai_sdk_asks_for_it(server: RunningServer) -> None:
    """@ai-sdk/anthropic's streamText body: each tool with ``eager_input_streaming: true``."""
    body = {"model": "tiny", "max_tokens": 60, "stream": True, "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}],
            "tools": [{**WEATHER, "eager_input_streaming": True}]}
    with server.http() as http, http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200, response.read()
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    jsonschema.validate(json.loads(partial), CITY)
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-1]["type"] == "message_stop"


def test_count_tokens_is_the_prompt_of_the_same_request(server: RunningServer) -> None:
    client = _client(server)
    conversation = dict(system="Count me.", messages=[{"role": "user", "content": "A prompt long enough to fill "
                                                       "a block or two of the prefix cache, and then some more."}])
    count = client.messages.count_tokens(model="tiny", **conversation)
    first = _create(server, max_tokens=2, **conversation).usage
    second = _create(server, max_tokens=2, **conversation).usage
    assert count.input_tokens == first.input_tokens + first.cache_read_input_tokens
    assert count.input_tokens == second.input_tokens + second.cache_read_input_tokens
    assert second.cache_read_input_tokens >= 16  # the prefix cache's hits, apart from the rest


def test_thinking_blocks(thinker: RunningServer) -> None:
    client = _client(thinker)
    args = dict(model="thinker", max_tokens=4096, messages=[{"role": "user", "content": "Capital?"}],
                thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=_greedy())
    message = _parsed(client.messages.create(**args))  # max_tokens past the context: the room left
    thought, answer = message.content
    assert (thought.type, thought.thinking, answer.type, answer.text) == ("thinking", THOUGHT, "text", ANSWER)
    assert thought.signature and message.stop_reason == "end_turn"
    assert message.usage.output_tokens_details.thinking_tokens == THOUGHT_TOKENS
    with client.messages.stream(**args) as stream:
        kinds = [(event.type, event.delta.type if event.type == "content_block_delta" else None) for event in stream]
        assert _parsed(stream.get_final_message()).content == message.content
    assert ("content_block_delta", "thinking_delta") in kinds
    assert kinds.index(("content_block_delta", "signature_delta")) < kinds.index(("content_block_stop", None))
    omitted = _parsed(client.messages.create(**{**args, "thinking": {**args["thinking"], "display": "omitted"}}))
    assert omitted.content[0].thinking == "" and omitted.content[0].signature == thought.signature
    off = _parsed(client.messages.create(**{**args, "thinking": {"type": "disabled"}}))
    assert [block.type for block in off.content] == ["text"] and off.content[0].text == ANSWER
    sent_back = [{"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}, *message.content]
    again = [*args["messages"], {"role": "assistant", "content": sent_back}, {"role": "user", "content": "Sure?"}]
    assert _parsed(client.messages.create(**{**args, "messages": again})).content[-1].text == ANSWER


@pytest.mark.parametrize(("change", "words"), [
    ({"frequency": 1}, "frequency"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "images"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "nonsense"}}]}, "tools.0.input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "budget_tokens"),
    ({"messages": [{"role": "user", "content": "x " * 1100}]}, "prompt is too long"),
])
def test_what_vivace_does_not_serve_is_an_invalid_request(server: RunningServer, change: dict, words: str) -> None:
    client = _client(server)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="tiny", messages=ASK, max_tokens=2, extra_body=change)
    assert refused.value.body["type"] == "error", refused.value.body
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert words in refused.value.body["error"]["message"]


def test_errors_are_anthropics(server: RunningServer) -> None:
    client = _client(server)
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.post("/v1/messages", cast_to=Message, body={"model": "tiny", "messages": ASK})
    assert missing.value.body["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-model", messages=ASK, max_tokens=2)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with server.http() as http:
        for response in (http.get("/v1/messages"), http.post("/v1/messages/batches", json={})):
            assert response.json()["type"] == "error" and response.json()["error"]["type"] in (
                "invalid_request_error", "not_found_error"), response.text
        assert "error" in http.post("/v1/chat/completions", json={"model": "nope", "messages": ASK}).json()


def test_keys_by_header_or_bearer_and_errors_past_the_start(keyed: RunningServer) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        _client(keyed, api_key="wrong").messages.create(model="tiny", messages=ASK, max_tokens=2)
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert _client(keyed, api_key=KEY).messages.create(model="tiny", messages=ASK, max_tokens=2).content
    assert _client(keyed, api_key=None, auth_token=KEY).messages.create(model="tiny", messages=ASK, max_tokens=2)
    with keyed.http() as http:  # the OpenAI endpoints take either header, and keep OpenAI's errors
        assert http.post("/v1/chat/completions", headers={"x-api-key": KEY},
                         json={"model": "tiny", "messages": ASK, "max_tokens": 2}).status_code == 200
        assert http.get("/v1/models").json()["error"]["code"] == "invalid_api_key"
        too_large = http.post("/v1/messages", headers={"x-api-key": KEY}, content=b"{" + b" " * 5000 + b"}")
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"
    client = _client(keyed, api_key=KEY)
    with pytest.raises(anthropic.APIStatusError) as late:  # past the 1 s timeout, after message_start
        with client.messages.stream(model="tiny", messages=ASK, max_tokens=1000, extra_body={"ignore_eos": True}) as s:
            for _ in s:
                pass
    assert late.value.body["type"] == "error" and late.value.body["error"]["type"] == "timeout_error"
    assert_engine_idle(keyed.engine)


def test_a_stream_abandoned_mid_answer_is_aborted(server: RunningServer) -> None:
    before = aborted(server)
    with _client(server).messages.stream(model="tiny", messages=ASK, max_tokens=900,
                                          extra_body={"ignore_eos": True}) as stream:
        for seen, _ in enumerate(stream):
            if seen == 5:
                break
    assert_aborted_and_idle(server, before)
    assert _create(server, max_tokens=2).content


def test_the_routes_are_in_the_contract(server: RunningServer) -> None:
    with server.http() as http:
        paths = http.get("/openapi.json").json()["paths"]
    for path, body in (("/v1/messages", "MessagesRequest"), ("/v1/messages/count_tokens", "MessagesPrompt")):
        operation = paths[path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + body)
        error = operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("/AnthropicErrorResponse")
    answers = paths["/v1/messages"]["post"]["responses"]["200"]["content"]
    assert set(answers) == {"application/json", "text/event-stream"}
