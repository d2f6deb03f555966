"""Structured output and tool calls on the real default model through the official client:
parsed objects, schema-valid answers, tool calls that assemble, a tool-result round trip, and
constrained requests beside free ones changing nothing for the free ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from .harness import RunningServer

pytestmark = pytest.mark.slow

# Every string is bounded, so a complete answer fits in max_tokens.
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "role": {"enum": ["admin", "user", "guest"]},
        "manager": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "code", "age", "score", "role", "manager", "address", "skills"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: float = Field(ge=0, le=100)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


def test_parse_returns_the_pydantic_object(default_server: RunningServer) -> None:
    answer = default_server.client().chat.completions.parse(
        model="smol", messages=[{"role": "user", "content": "Describe Paris."}], response_format=City,
        max_tokens=100, temperature=0)
    assert isinstance(answer.choices[0].message.parsed, City)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_answers_validate(default_server: RunningServer, temperature: float) -> None:
    answer = default_server.client().chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Invent a user profile."}], max_tokens=200,
        temperature=temperature, seed=7, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "profile", "schema": PROFILE,
                                                                "strict": True}})
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PROFILE)


def _assemble(stream: Iterator) -> tuple[str, list[dict], str | None]:
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return content, list(calls.values()), reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                         "auto"])
def test_tool_calls_assemble_to_valid_arguments(default_server: RunningServer, stream: bool, tool_choice: object) -> None:
    request = dict(model="smol", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=tool_choice,
                   max_tokens=80, temperature=0)
    client = default_server.client()
    if stream:
        content, calls, reason = _assemble(client.chat.completions.create(**request, stream=True))
    else:
        message = (answer := client.chat.completions.create(**request)).choices[0].message
        content, reason = message.content or "", answer.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls or []]
    if tool_choice == "auto" and not calls:
        assert reason == "stop" and content  # the model chose to answer in words
        return
    assert reason == "tool_calls" and calls
    for call in calls:
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_tool_result_round_trip(default_server: RunningServer) -> None:
    client = default_server.client()
    first = client.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER],
                                           tool_choice="required", max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK_WEATHER + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    second = client.chat.completions.create(model="smol", messages=history, tools=[WEATHER],
                                            max_tokens=40, temperature=0)
    assert second.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    assert second.choices[0].message.content or second.choices[0].message.tool_calls


def test_schema_free_grammar_keeps_greedy_output(default_server: RunningServer) -> None:
    client = default_server.client()
    request = dict(model="smol", messages=[{"role": "user", "content": "Name three colors."}],
                   max_tokens=24, temperature=0)
    free = client.chat.completions.create(**request)
    anything = client.chat.completions.create(**request, extra_body={"guided_regex": "(?s:.*)"})
    assert anything.choices[0].message.content == free.choices[0].message.content


def test_mixed_batch_gives_each_its_own_answer(default_server: RunningServer) -> None:
    client = default_server.client()
    questions = ["What is the capital of France?", "Name a large animal.", "Say hello."]
    free = dict(model="smol", max_tokens=20, temperature=0)
    alone = [client.chat.completions.create(**free, messages=[{"role": "user", "content": q}])
             .choices[0].message.content for q in questions]
    constrained = dict(model="smol", max_tokens=200, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "profile", "schema": PROFILE}})
    with ThreadPoolExecutor(6) as pool:
        free_jobs = [pool.submit(client.chat.completions.create, **free, messages=[{"role": "user", "content": q}])
                     for q in questions]
        json_jobs = [pool.submit(client.chat.completions.create, **constrained,
                                 messages=[{"role": "user", "content": q}]) for q in questions]
        assert [job.result().choices[0].message.content for job in free_jobs] == alone
        for job in json_jobs:
            jsonschema.validate(json.loads(job.result().choices[0].message.content), PROFILE)
