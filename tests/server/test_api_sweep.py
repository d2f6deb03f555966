"""What OpenAI clients and vLLM users send, beyond the plain requests the other modules check:
nulls for defaults and the newer bookkeeping fields, answers sent back as the client dumps them,
one model's card, the chosen token among completions' top_logprobs, calls cut short, CORS, and
vLLM's continue_final_message."""

from __future__ import annotations

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion

from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings
from vivace.server.tool_parser import ToolCallParser, parse_tool_calls

from .conftest import MAX_MODEL_LEN
from .harness import RunningServer, serving

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}


def test_null_means_the_default_as_in_openai(server: RunningServer) -> None:
    nulls = dict.fromkeys(["n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                           "stop", "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias",
                           "user", "tools", "tool_choice", "parallel_tool_calls", "response_format"])
    with server.http() as http:
        chat = http.post(CHAT, json={"model": "tiny", "messages": HI, "max_tokens": 2, **nulls,
                                     "safety_identifier": "user-7", "prompt_cache_key": "k"})  # bookkeeping
        text = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": None, "echo": None, "suffix": None,
                                            "best_of": None, "n": None, "ignore_eos": True})
        schema = http.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
    assert chat.status_code == 200, chat.text
    assert ChatCompletion.model_validate(chat.json()).choices[0].logprobs is None
    assert text.status_code == 200, text.text
    usage = Completion.model_validate(text.json()).usage
    assert usage.prompt_tokens + usage.completion_tokens == MAX_MODEL_LEN  # null: all the room left, as vLLM
    assert {"type": "null"} in schema["properties"]["temperature"]["anyOf"]  # the contract says so



def test_stream_obfuscation_option_is_accepted(server: RunningServer) -> None:
    """OpenAI's ``stream_options.include_obfuscation`` (which OpenAI suggests turning off) changes
    nothing here: vivace's events carry no padding."""
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=HI, max_tokens=1, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens == 1 and not any("obfuscation" in c.model_extra for c in chunks)

def test_tokenize_renders_tools_as_chat_does(server: RunningServer) -> None:
    """``/tokenize`` of messages with tools gives the prompt chat completions feeds the engine, for
    every tool_choice ("none" leaves the tools out of the template)."""
    counts = {}
    with server.http() as http:
        for choice in ("none", "auto", "required"):
            body = {"messages": HI, "tools": [WEATHER], "tool_choice": choice}
            tokens = http.post("/tokenize", json=body).json()
            chat = http.post(CHAT, json={"model": "tiny", "max_tokens": 1, **body}).json()
            assert tokens["count"] == chat["usage"]["prompt_tokens"], (choice, tokens, chat)
            counts[choice] = tokens["count"]
    assert counts["none"] < counts["auto"] == counts["required"]


def test_an_answer_sent_back_as_the_client_dumps_it_is_accepted(server: RunningServer) -> None:
    client = server.client()
    answer = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2).choices[0].message
    dumped = answer.model_dump()  # refusal, annotations, audio, function_call: all None
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    again = client.chat.completions.create(
        model="tiny", max_tokens=2,
        messages=[*HI, dumped, {"role": "user", "content": "and?"},
                  {"role": "assistant", "content": None, "refusal": "I can't."}, {"role": "user", "content": "ok"}])
    assert again.choices[0].message.role == "assistant"


def test_one_model_card_and_unknown_names(server: RunningServer) -> None:
    client = server.client()
    card = client.models.retrieve("tiny")
    assert isinstance(card, Model) and card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("org/other-model")
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as embeddings:
        client.embeddings.create(model="tiny", input="hi")
    assert embeddings.value.body["message"] == "Invalid URL (POST /v1/embeddings)"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_completion_top_logprobs_hold_the_chosen_token(server: RunningServer, stream: bool, k: int) -> None:
    client = server.client()
    args = dict(model="tiny", prompt="The sky is", max_tokens=3, logprobs=k, temperature=1.0, seed=3)
    if stream:
        steps = [lp for chunk in client.completions.create(**args, stream=True) for choice in chunk.choices
                 if (lp := choice.logprobs) is not None]
        tokens = [t for lp in steps for t in lp.tokens]
        tops = [top for lp in steps for top in lp.top_logprobs]
        chosen = [v for lp in steps for v in lp.token_logprobs]
    else:
        logprobs = client.completions.create(**args).choices[0].logprobs
        tokens, tops, chosen = logprobs.tokens, logprobs.top_logprobs, logprobs.token_logprobs
    assert len(tokens) == len(tops) == 3
    for token, top, value in zip(tokens, tops, chosen):
        assert top[token] == pytest.approx(value) and len(top) <= k + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_before_its_name_is_no_call(server: RunningServer, stream: bool) -> None:
    client = server.client()
    args = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                tool_choice="required", max_tokens=2)  # "<tool_call>", "\n": no name yet
    if stream:
        chunks = list(client.chat.completions.create(**args, stream=True))
        calls = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or []]
        reason = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    else:
        choice = client.chat.completions.create(**args).choices[0]
        calls, reason = choice.message.tool_calls or [], [choice.finish_reason]
    assert calls == [] and reason == ["length"]


def test_calls_without_a_name_are_dropped_and_name_last_calls_stream() -> None:
    assert parse_tool_calls('<tool_call>\n{"na') == (None, [])
    parser = ToolCallParser()
    _, deltas = parser.feed('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>')
    assert [(d.name, d.arguments) for d in deltas] == [("f", '{"x": 1}')] and deltas[0].id


def test_browsers_may_call_the_api_from_other_origins(server: RunningServer, tiny_engine: AsyncEngine) -> None:
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with server.http() as http:
        allowed = http.options(CHAT, headers=preflight)
        answer = http.post(CHAT, json={"messages": HI, "max_tokens": 1}, headers={"Origin": "http://localhost:3000"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "*"
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    exposed = answer.headers["access-control-expose-headers"].lower().split(", ")
    assert {"x-request-id", "retry-after"} <= set(exposed)
    with serving(tiny_engine, ServerSettings(allowed_origins=())) as closed, closed.http() as http:
        refused = http.options(CHAT, headers=preflight)
    assert refused.status_code == 405 and "access-control-allow-origin" not in refused.headers


def test_continue_final_message_leaves_the_last_turn_open(server: RunningServer) -> None:
    client = server.client()
    prefill = [*HI, {"role": "assistant", "content": "Hello, I am"}]
    new_turn = client.chat.completions.create(model="tiny", messages=prefill, max_tokens=1)
    continued = client.chat.completions.create(
        model="tiny", messages=prefill, max_tokens=1,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    # Without the closing "<|im_end|>\n" and the new "<|im_start|>assistant\n".
    assert continued.usage.prompt_tokens < new_turn.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(model="tiny", messages=prefill, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    assert both.value.body["param"] == "continue_final_message"
