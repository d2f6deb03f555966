"""Structured output and tool calls over HTTP on the tiny random model: whatever it would have
said, the grammar holds it to the schema, and the official client reads the answers."""

from __future__ import annotations

import json
import re
import uuid

from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from .harness import RunningServer

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["color", "size", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture
def server(tools_server: RunningServer) -> RunningServer:
    return tools_server


def test_response_format_json_schema_and_json_object(server: RunningServer) -> None:
    client = server.client()
    for temperature in (0.0, 0.9):
        answer = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=60, temperature=temperature, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    anything = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")


def test_vllm_extras_on_completions(server: RunningServer) -> None:
    client = server.client()
    choice = client.completions.create(model="tiny", prompt="Yes or no?", max_tokens=8,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in {"yes", "no"}
    regex = client.completions.create(model="tiny", prompt="Code:", max_tokens=8,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", regex.choices[0].text)
    grammar = client.completions.create(model="tiny", prompt="Go:", max_tokens=8,
                                        extra_body={"guided_grammar": 'root ::= "go " ("left" | "right")'})
    assert grammar.choices[0].text in {"go left", "go right"}
    cut = client.completions.create(model="tiny", prompt="Say:", max_tokens=3,
                                    extra_body={"guided_json": {"type": "array", "items": {"type": "string"}}})
    assert cut.choices[0].finish_reason == "length"


def test_llama_cpp_grammar_and_json_schema_fields(server: RunningServer) -> None:
    """llama.cpp server's ``grammar`` (GBNF) and ``json_schema`` body fields constrain as vLLM's do."""
    client = server.client()
    grammar = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8,
                                             extra_body={"grammar": 'root ::= "go " ("left" | "right")'})
    assert grammar.choices[0].message.content in {"go left", "go right"}
    schema = client.completions.create(model="tiny", prompt="Thing:", max_tokens=60, extra_body={"json_schema": SCHEMA})
    assert schema.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_assemble(server: RunningServer, stream: bool, choice: object) -> None:
    # A named function is called once; "required" is held to one call by parallel_tool_calls.
    request = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120,
                   temperature=0, parallel_tool_calls=isinstance(choice, dict))
    client = server.client()
    if stream:
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in client.chat.completions.create(**request, stream=True):
            for c in chunk.choices:
                reasons.append(c.finish_reason)
                for delta in c.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"name": None, "arguments": "", "id": delta.id})
                    call["name"] = call["name"] or delta.function.name
                    call["arguments"] += delta.function.arguments or ""
        assert reasons[-1] == "tool_calls"
        assembled = list(calls.values())
    else:
        answer = client.chat.completions.create(**request)
        assert answer.choices[0].finish_reason == "tool_calls"
        assert answer.choices[0].message.content is None
        assembled = [{"name": c.function.name, "arguments": c.function.arguments, "id": c.id}
                     for c in answer.choices[0].message.tool_calls]
    assert len(assembled) == 1 and assembled[0]["id"].startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[assembled[0]["name"]]
    if isinstance(choice, dict):
        assert assembled[0]["name"] == "get_time"
    jsonschema.validate(json.loads(assembled[0]["arguments"]), tool["function"]["parameters"])


def test_max_tokens_inside_the_next_calls_opener_leaves_no_content(server: RunningServer) -> None:
    """The bodies the Vercel AI SDK sends for ``toolChoice: "required"`` (chat's ``required``, the
    Messages API's ``any``), cut by max_tokens inside the opener of a second call: the first call
    alone, no "<tool" as content (nor as a text block), streamed or whole."""
    client = server.client()
    for seed in range(40):  # a seed whose answer makes two calls
        body = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=seed)
        tokens = [t.token for t in client.chat.completions.create(
            **body, max_tokens=120, logprobs=True).choices[0].logprobs.content]
        if "".join(tokens).count("<tool_call>") > 1:
            break
    closed = next(i for i in range(len(tokens)) if "</tool_call>" in "".join(tokens[:i + 1])) + 1
    cut = next(i for i in range(closed, len(tokens)) if "".join(tokens[closed:i]).strip() not in ("", "<tool_call>")
               and "<tool_call>".startswith("".join(tokens[closed:i]).strip()))
    answer = client.chat.completions.create(**body, max_tokens=cut).choices[0]
    assert answer.finish_reason == "length" and answer.message.content is None
    assert [c.function.name for c in answer.message.tool_calls] == ["get_weather"]
    streamed = [c.choices[0].delta for c in client.chat.completions.create(**body, max_tokens=cut, stream=True)
                if c.choices]
    assert "".join(d.content or "" for d in streamed) == ""
    with server.http() as http:
        message = http.post("/v1/messages", json={
            "model": "tiny", "max_tokens": cut, "tool_choice": {"type": "any"}, "temperature": 1.0, "seed": seed,
            "messages": [{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}],
            "tools": [{"name": "get_weather", "description": WEATHER["function"]["description"],
                       "input_schema": WEATHER["function"]["parameters"]}]}).json()
    assert [block["type"] for block in message["content"]] == ["tool_use"], message


def test_tool_round_trip_is_accepted_and_none_means_text(server: RunningServer) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"unit": "c", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    client = server.client()
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=5)
    assert answer.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    plain = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                           tool_choice="none", max_tokens=5)
    assert plain.choices[0].message.tool_calls is None


def test_history_calls_as_agent_frameworks_send_them_back_are_accepted(server: RunningServer) -> None:
    """What vLLM takes in a call sent back: ``arguments`` as the object (LangChain), text that is no
    JSON object (a call max_tokens cut), the ``index`` of calls assembled from a stream's deltas; and
    a Responses API ``function_call`` item's arguments as the object."""
    client = server.client()
    for arguments, extra in (({"unit": "c", "days": 1}, {}), ('{"unit": "c", "da', {}), ('{"unit": "c", "days": 1}', {"index": 0})):
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}, **extra}
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
        answer = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=3)
        assert answer.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    response = client.responses.create(model="tiny", max_output_tokens=3, tools=[{
        "type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}], input=[
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": {"unit": "c", "days": 1}},
        {"type": "function_call_output", "call_id": "call_1", "output": "21"}])
    assert response.status in {"completed", "incomplete"}


class Weather(BaseModel):
    unit: Literal["c", "f"]
    days: Literal[1, 2, 3]


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the client's, dumping its own parsed model
def test_a_parsed_answer_sent_back_as_the_client_sends_it_is_accepted(server: RunningServer) -> None:
    """The openai client's ``parse`` answers carry ``parsed`` (the message) and ``parsed_arguments``
    (each call); appending the message to the conversation, as OpenAI's docs do, sends them back."""
    client = server.client()
    common = dict(model="tiny", max_tokens=40, parallel_tool_calls=False)
    called = client.chat.completions.parse(messages=ASK, tools=[openai.pydantic_function_tool(Weather)],
                                           tool_choice="required", **common).choices[0].message
    assert isinstance(called.tool_calls[0].function.parsed_arguments, Weather)
    history = [*ASK, called, {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": "21"}]
    said = client.chat.completions.parse(messages=history, response_format=Weather, **common).choices[0].message
    assert isinstance(said.parsed, Weather)
    again = client.chat.completions.create(messages=[*history, said, {"role": "user", "content": "ok"}], **common)
    assert again.choices[0].message.role == "assistant"


BAD = [
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}), "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format.json_schema.schema"),
    (dict(guided_regex="(", guided_choice=["a"]), "guided_choice"),
    (dict(guided_regex="(unclosed"), "guided_regex"),
    (dict(guided_regex=r"[^\x00-\x{10FFFF}]"), "guided_regex"),  # compiles, yet no text matches it
    (dict(guided_json="{not json"), "guided_json"),
    (dict(guided_grammar="start: undefined_rule"), "guided_grammar"),
    (dict(grammar="root ::= undefined_rule"), "grammar"),
    (dict(json_schema={"type": "nope"}), "json_schema"),
    (dict(guided_choice=["a"], grammar='root ::= "a"'), "grammar"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]),
     "tools.0.function.parameters"),
    # arguments are an object: a string schema let the model write a call its parser misread
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools.0.function.parameters"),
    # the answer's schema is checked whichever tool choice wins
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}), "response_format.json_schema.schema"),
    (dict(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]), "messages.0.tool_call_id"),
    (dict(structured_outputs={"json_object": True, "whitespace_pattern": "(unclosed"}),
     "structured_outputs.whitespace_pattern"),
]


@pytest.mark.parametrize("changes,param", BAD, ids=[p for _, p in BAD])
def test_bad_constraints_are_400s_naming_the_field(server: RunningServer, changes: dict, param: str) -> None:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **changes}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text


def _outcome(message, finish_reason: str) -> str:
    """"answer" when ``message`` is SCHEMA's JSON, "call" when it is valid tool calls; else fails."""
    if message.tool_calls:
        assert finish_reason == "tool_calls" and message.content is None, message
        for call in message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        return "call"
    assert finish_reason == "stop", message
    jsonschema.validate(json.loads(message.content), SCHEMA)
    return "answer"


def _streamed(client: openai.OpenAI, **request: object):
    """The whole message a stream assembles, and its finish reason."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(**request, stream=True):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            content += c.delta.content or ""
            for delta in c.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "type": "function",
                                                      "function": {"name": delta.function.name, "arguments": ""}})
                call["function"]["arguments"] += delta.function.arguments or ""
    message = openai.types.chat.ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": content or None, "tool_calls": list(calls.values()) or None})
    return message, reason


@pytest.mark.parametrize("stream", [False, True])
def test_tools_with_a_response_format_answer_in_the_schema_or_call_them(server: RunningServer, stream: bool) -> None:
    """What an agent with tools and an output type sends (the openai-agents SDK, LangChain): with
    "auto" the answer is either the schema's JSON or tool calls, whichever the model begins;
    "required" makes calls, "none" answers in the schema."""
    client = server.client()
    form = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    common = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], response_format=form, max_tokens=120)
    seen = set()
    for seed in range(8):
        request = dict(common, temperature=1.0, seed=seed)
        if stream:
            seen.add(_outcome(*_streamed(client, **request)))
        else:
            choice = client.chat.completions.create(**request).choices[0]
            seen.add(_outcome(choice.message, choice.finish_reason))
    assert seen == {"answer", "call"}  # the random model takes both ways
    for choice, outcome in (("required", "call"), ("none", "answer")):
        answer = client.chat.completions.create(**common, tool_choice=choice, temperature=0).choices[0]
        assert _outcome(answer.message, answer.finish_reason) == outcome


def test_tools_with_a_text_format_in_the_responses_and_messages_apis(server: RunningServer) -> None:
    client = server.client()
    tool = {"type": "function", "name": "get_time", "parameters": TIME["function"]["parameters"]}
    outcomes = set()
    for seed in range(6):
        response = client.responses.create(model="tiny", input=ASK[0]["content"], tools=[tool], max_output_tokens=120,
                                           temperature=1.0, extra_body={"seed": seed}, text={"format": {
                                               "type": "json_schema", "name": "thing", "schema": SCHEMA}})
        if response.output[0].type == "function_call":
            jsonschema.validate(json.loads(response.output[0].arguments), TIME["function"]["parameters"])
            outcomes.add("call")
        else:
            jsonschema.validate(json.loads(response.output_text), SCHEMA)
            outcomes.add("answer")
    assert outcomes == {"answer", "call"}
    with server.http() as http:
        message = http.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 120, "messages": [{"role": "user", "content": ASK[0]["content"]}],
            "tools": [{"name": "get_time", "input_schema": TIME["function"]["parameters"]}],
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    assert message.status_code == 200, message.text
    blocks = message.json()["content"]
    if blocks[0]["type"] == "tool_use":
        jsonschema.validate(blocks[0]["input"], TIME["function"]["parameters"])
    else:
        jsonschema.validate(json.loads(blocks[0]["text"]), SCHEMA)


def test_vllm_structured_output_options_are_taken(server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's options beside a constraint: ``disable_any_whitespace`` / ``disable_additional_properties``
    (what vivace does anyway), a whitespace pattern JSON then takes between its tokens, and
    ``guided_decoding_backend`` (another backend than llguidance is a warning, as in vLLM V1)."""
    client = server.client()
    compact = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0, extra_body={
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True, "disable_additional_properties": True}})
    jsonschema.validate(json.loads(compact.choices[0].message.content), SCHEMA)
    assert compact.choices[0].message.content == json.dumps(json.loads(compact.choices[0].message.content))
    backend = f"xgrammar:{uuid.uuid4().hex}"  # vLLM V0's "name:options", new to the server's log
    spaced = {"guided_json": SCHEMA, "guided_whitespace_pattern": "\n {0,2}", "guided_decoding_backend": backend}
    seen = set()
    for seed in range(4):
        text = client.completions.create(model="tiny", prompt="Thing:", max_tokens=80, temperature=1.0, seed=seed,
                                         extra_body=spaced).choices[0].text
        jsonschema.validate(json.loads(text), SCHEMA)
        seen.add(text == json.dumps(json.loads(text), separators=(",", ":")))
    assert False in seen  # the random model took some of the whitespace the pattern gave it
    assert f"guided_decoding_backend {backend!r} ignored" in caplog.text
