"""``POST /v1/responses`` through the official openai client: plain and message-list input,
max_output_tokens, the streamed events and the answer they assemble, function tools and their
round trip, json_schema output, and the 400s of what vivace doesn't serve."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseErrorEvent, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from vivace.engine.outputs import CompletionOutput, FinishReason
from vivace.server.errors import APIError
from vivace.server.responses_objects import ResponseObject
from vivace.server.responses_stream import ResponseEvents, response_events
from vivace.server.tool_parser import parse_tool_calls

from .harness import RunningServer

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
FLAG = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": CITY, "strict": True}


@pytest.fixture
def server(tools_server: RunningServer) -> RunningServer:
    return tools_server


def _bare_answer() -> ResponseObject:
    return ResponseObject(id="resp-1", model="tiny", instructions=None, max_output_tokens=None, temperature=1.0,
                          top_p=1.0, parallel_tool_calls=True, tool_choice="auto", tools=[], text={},
                          reasoning=None, metadata={}, store=False, user=None)


def _parsed(response: Response) -> Response:
    """The answer re-validated strictly by the client's own type (the client itself is lenient)."""
    return Response.model_validate(response.model_dump(mode="json", exclude_unset=True))


def test_string_input(server: RunningServer) -> None:
    response = _parsed(server.client().responses.create(model="tiny", input="hi", max_output_tokens=4,
                                                        temperature=0, metadata={"k": "v"}, store=True))
    assert response.object == "response" and response.model == "tiny" and response.error is None
    assert response.id.startswith("resp_")  # as OpenAI's and vLLM's ids
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and response.output_text == message.content[0].text
    usage = response.usage
    assert usage.output_tokens <= 4 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.metadata == {"k": "v"} and response.temperature == 0 and response.max_output_tokens == 4


def test_openai_hints_are_accepted_and_echoed(server: RunningServer) -> None:
    response = _parsed(server.client().responses.create(
        model="tiny", input="hi", max_output_tokens=4, text={"verbosity": "low"}, prompt_cache_retention="in-memory"))
    assert response.text.verbosity == "low" and response.text.format.type == "text"
    assert response.status in ("completed", "incomplete")


def test_messages_with_instructions_are_the_chat_conversation(server: RunningServer) -> None:
    client = server.client()
    input_items = [{"role": "developer", "content": "Answer briefly."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
                   {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
                   {"role": "user", "content": "Who are you?"}]
    response = client.responses.create(model="tiny", instructions="You are a bot.", input=input_items,
                                       max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model="tiny", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "You are a bot."}, {"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
                  {"role": "user", "content": "Who are you?"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "You are a bot."


def test_max_output_tokens_makes_it_incomplete(server: RunningServer) -> None:
    response = _parsed(server.client().responses.create(
        model="tiny", input="Tell me a long story", max_output_tokens=3, temperature=0,
        extra_body={"ignore_eos": True}))
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete" and response.usage.output_tokens == 3


def test_stream_events_in_order_assemble_the_greedy_answer(server: RunningServer) -> None:
    client = server.client()
    args = dict(model="tiny", input="Count to five", max_output_tokens=8, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    kinds = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert len(deltas) == 8  # one per token, as chat streams
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = _parsed(events[-1].response)
    assert "".join(d.delta for d in deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == 8
    # A schema's grammar ends the answer, so the client's stream helper sees it complete.
    shaped = dict(model="tiny", input="A flag", max_output_tokens=30, temperature=0,
                  text={"format": {"type": "json_schema", "name": "flag", "schema": FLAG}})
    with client.responses.stream(**shaped) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        assembled = stream.get_final_response()
    assert assembled.status == "completed" and assembled.output_text == "".join(texts)
    assert assembled.output_text == client.responses.create(**shaped).output_text
    jsonschema.validate(json.loads(assembled.output_text), FLAG)


def test_output_text_logprobs_whole_and_streamed_are_chat_logprobs(server: RunningServer) -> None:
    """With ``include: ["message.output_text.logprobs"]`` the answer's text carries its tokens'
    logprobs, each with ``top_logprobs`` alternatives, as vLLM serves them: chat's numbers for the
    same conversation; streamed, each text delta carries its token's, and the done event them all."""
    client = server.client()
    args = dict(model="tiny", input="Count to five", max_output_tokens=6, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})
    whole = _parsed(client.responses.create(**args))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count to five"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True}).choices[0].logprobs.content
    text = whole.output[0].content[0]
    assert whole.top_logprobs == 2 and len(text.logprobs) == 6
    assert [(lp.token, lp.logprob, lp.bytes) for lp in text.logprobs] == [(lp.token, lp.logprob, lp.bytes) for lp in chat]
    assert all([top.token for top in lp.top_logprobs] == [top.token for top in theirs.top_logprobs]
               for lp, theirs in zip(text.logprobs, chat))
    events = list(client.responses.create(**args, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [[lp.token for lp in d.logprobs] for d in deltas] == [[lp.token] for lp in text.logprobs]
    assert [lp.logprob for lp in done.logprobs] == [lp.logprob for lp in text.logprobs]
    plain = client.responses.create(**{**args, "include": omit})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == whole.output_text


def test_required_function_call_and_its_round_trip(server: RunningServer) -> None:
    client = server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = _parsed(client.responses.create(model="tiny", input=ask, tools=[WEATHER], tool_choice="required",
                                               parallel_tool_calls=False, temperature=0, max_output_tokens=60))
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert response.tools[0].name == "get_weather" and response.tool_choice == "required"
    streamed = list(client.responses.create(model="tiny", input=ask, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_output_tokens=60,
                                            stream=True))
    arguments = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert "".join(arguments) == done.arguments == call.arguments
    answer = client.responses.create(
        model="tiny", tools=[WEATHER], max_output_tokens=5, temperature=0,
        input=[*ask, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert answer.status == "completed" or answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output[0].type in ("message", "function_call")


def test_named_function_and_json_schema_output(server: RunningServer) -> None:
    client = server.client()
    named = client.responses.create(model="tiny", input="weather?", tools=[WEATHER], max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]
    fmt = {"type": "json_schema", "name": "place", "schema": CITY, "strict": True}
    shaped = client.responses.create(model="tiny", input="A city, as JSON", text={"format": fmt},
                                     max_output_tokens=60, temperature=0)
    assert shaped.status == "completed", shaped.incomplete_details
    jsonschema.validate(json.loads(shaped.output_text), CITY)
    assert shaped.text.format.type == "json_schema" and shaped.text.format.name == "place"

    class Flag(BaseModel):
        on: bool

    parsed = client.responses.parse(model="tiny", input="A flag", text_format=Flag, max_output_tokens=30)
    assert isinstance(parsed.output_parsed, Flag)


@pytest.mark.parametrize(("change", "param"), [
    ({"frequency": 1}, "frequency"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input.0"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"}]},
     "input.0.encrypted_content"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": [{**WEATHER, "parameters": {"type": "nonsense"}}]}, "tools.0.parameters"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"max_output_tokens": 5000}, "input"),
    ({"include": ["message.output_text.logprobs"], "tools": [WEATHER]}, "include"),
])
def test_what_vivace_does_not_serve_is_a_400_naming_it(server: RunningServer, change: dict, param: str) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body=change)
    assert refused.value.body["param"] == param, refused.value.body
    assert refused.value.body["type"] == "invalid_request_error"
    if param == "previous_response_id":
        assert "stores no responses" in refused.value.body["message"]
    assert client.responses.create(model="tiny", input="still there?", max_output_tokens=2).output


def test_the_route_is_in_the_contract(server: RunningServer) -> None:
    with server.http() as http:
        spec = http.get("/openapi.json").json()
    operation = spec["paths"]["/v1/responses"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    limit = spec["components"]["schemas"]["ResponsesRequest"]["properties"]["max_output_tokens"]["anyOf"][0]
    assert limit["maximum"] == 1023


def test_text_then_calls_stream_as_a_message_then_function_call_items() -> None:
    """Tool-call parsing in a stream ("auto": text, then two calls), checked by the client's own
    event types and its stream accumulator, against the whole answer's items."""
    answer = _bare_answer()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    events = ResponseEvents(answer, calls=True)
    frames = events.start()
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        frames += events.feed(CompletionOutput(0, piece, [i], None, FinishReason.STOP if last else None))
    frames += events.finish(incomplete=False)
    answer.status = "completed"
    frames.append(events.lifecycle("response.completed"))
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(json.loads(frame.split("\ndata: ", 1)[1])) for frame in frames]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    state = ResponseStreamState(input_tools=[WEATHER], text_format=omit)
    for event in parsed:
        state.handle_event(event)
    final = state._completed_response
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]
    assert final.output_text == "Let me check."
    assert [json.loads(item.arguments) for item in final.output[1:]] == [{"city": "Paris"}, {"city": "Rome"}]
    content, calls = parse_tool_calls(text)
    assert content == final.output_text and [c.arguments for c in calls] == [i.arguments for i in final.output[1:]]


def test_raw_stream_is_openai_event_frames(server: RunningServer) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/responses", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = raw.strip().split("\n\n")
    assert "[DONE]" not in raw
    for frame in frames:
        event, data = frame.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]


def test_an_error_after_the_stream_started_is_an_error_event() -> None:
    class FailingJob:
        choices: list = []

        async def deltas(self):
            raise APIError(504, "The request ran longer than its 1 s timeout", code="request_timeout")
            yield

    answer = _bare_answer()

    async def collect() -> list[str]:
        return [frame async for frame in response_events(FailingJob(), answer, calls=False)]

    last = asyncio.run(collect())[-1]
    assert last.startswith("event: error\n")
    error = ResponseErrorEvent.model_validate(json.loads(last.split("\ndata: ", 1)[1]))
    assert error.code == "request_timeout" and error.sequence_number == 4
