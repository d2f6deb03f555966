"""OpenAI's legacy function calling over HTTP (``vivace.server.functions``), with the bodies the
clients that still speak it send: litellm passes a caller's ``functions`` and ``function_call``
through, LangChain writes an ``AIMessage``'s ``function_call`` and a ``FunctionMessage`` into the
history. The answer is the legacy shape the openai client reads: ``message.function_call``,
``delta.function_call`` pieces, ``finish_reason: "function_call"``."""

from __future__ import annotations

import json

import jsonschema
import pytest

from .harness import RunningServer

WEATHER = {"name": "get_weather", "description": "Get weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# What litellm sent for ``completion(model="openai/...", functions=[...], function_call={...})``.
LITELLM_BODY = {"model": "tiny", "messages": ASK, "max_tokens": 40, "functions": [WEATHER],
                "function_call": {"name": "get_weather"}}
# What LangChain's ChatOpenAI sent for [HumanMessage, AIMessage(function_call=...), FunctionMessage].
LANGCHAIN_HISTORY = [
    {"content": "w?", "role": "user"},
    {"content": None, "role": "assistant", "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}},
    {"content": "ok", "name": "get_weather", "role": "function"}]


@pytest.fixture
def server(tools_server: RunningServer) -> RunningServer:
    return tools_server


def test_functions_are_called_and_answered_in_the_legacy_shape(server: RunningServer) -> None:
    with server.http() as http:
        answer = http.post("/v1/chat/completions", json=LITELLM_BODY).json()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "function_call", answer
    assert "tool_calls" not in choice["message"]
    call = choice["message"]["function_call"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])


def test_a_streamed_function_call_comes_in_delta_function_call_pieces(server: RunningServer) -> None:
    chunks = list(server.client().chat.completions.create(
        **LITELLM_BODY, stream=True, temperature=0.9, seed=3))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(d.tool_calls is None for d in deltas)
    pieces = [d.function_call for d in deltas if d.function_call is not None]
    assert pieces[0].name == "get_weather" and all(p.name is None for p in pieces[1:])
    jsonschema.validate(json.loads("".join(p.arguments for p in pieces)), WEATHER["parameters"])
    assert chunks[-1].choices[0].finish_reason == "function_call"


def test_a_function_call_history_is_rendered_as_a_tool_round_trip(server: RunningServer) -> None:
    client = server.client()
    called = client.chat.completions.create(**LITELLM_BODY).choices[0].message
    again = client.chat.completions.create(model="tiny", max_tokens=4, functions=[WEATHER], messages=[
        *ASK, called.model_dump(), {"role": "function", "name": "get_weather", "content": "Sunny"}])
    assert again.choices[0].message.role == "assistant"
    with server.http() as http:
        tokens = http.post("/tokenize", json={"messages": LANGCHAIN_HISTORY}).json()
        chat = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": LANGCHAIN_HISTORY, "max_completion_tokens": 2, "temperature": 0.0}).json()
        as_tools = http.post("/tokenize", json={"messages": [
            LANGCHAIN_HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": LANGCHAIN_HISTORY[1]["function_call"]}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "ok"}]}).json()
    assert tokens["tokens"] == as_tools["tokens"]
    assert chat["usage"]["prompt_tokens"] == tokens["count"]


@pytest.mark.parametrize("changes, param", [
    (dict(tools=[{"type": "function", "function": WEATHER}]), "functions"),
    (dict(function_call={"name": "get_time"}), "function_call.name"),
    (dict(functions=None), "function_call"),
    (dict(functions=[{**WEATHER, "parameters": {"type": "object", "uniqueItems": True}}]), "functions.0.parameters"),
    (dict(function_call=None, messages=[*ASK, {"role": "function", "content": "Sunny"}]), "messages.1.name"),
    (dict(function_call=None, messages=[*ASK, {"role": "user", "content": "x", "function_call": {
        "name": "get_weather", "arguments": "{}"}}]), "messages.1.function_call"),
])
def test_bad_legacy_requests_are_400s_naming_the_field(server: RunningServer, changes: dict, param: str) -> None:
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={**LITELLM_BODY, **changes})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error
