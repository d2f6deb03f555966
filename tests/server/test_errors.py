"""Every bad input gets its status and an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings

from .conftest import MAX_MODEL_LEN
from .harness import RunningServer, assert_engine_idle, serving

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GOOD_COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def chat(**changes: object) -> dict:
    return {**GOOD_CHAT, **changes}


def completion(**changes: object) -> dict:
    return {**GOOD_COMPLETION, **changes}


CASES = [
    # (path, body, status, the field the error's param must name (or lie under), or None)
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema"),
    (CHAT, chat(logit_bias={"42": 500}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"99999999": 5}), 400, "logit_bias"),
    (CHAT, chat(function_call="auto"), 400, "function_call"),
    (CHAT, chat(frobnicate=True), 400, "frobnicate"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages.0.tool_call_id"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages.0.content.0"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"text": "hi"}]}]), 400, "messages.0.content.0.type"),
    (CHAT, chat(temperature=-1), 400, "temperature"),
    (CHAT, chat(top_p=0), 400, "top_p"),
    (CHAT, chat(n=0), 400, "n"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_tokens="many"), 400, "max_tokens"),
    (CHAT, chat(top_logprobs=3), 400, "top_logprobs"),
    (CHAT, chat(top_logprobs=21, logprobs=True), 400, "top_logprobs"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, chat(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    (COMPLETIONS, completion(min_tokens=5), 400, "min_tokens"),
    (CHAT, chat(max_tokens=MAX_MODEL_LEN), 400, "messages"),
    (CHAT, chat(model="gpt-17"), 404, "model"),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=""), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[10**9]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[-1]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt"),
    (COMPLETIONS, completion(suffix="end"), 400, "suffix"),
    (COMPLETIONS, completion(best_of=3), 400, "best_of"),
    (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),  # 0 only with echo
    (COMPLETIONS, completion(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    (COMPLETIONS, completion(prompt="x" * 2000, max_tokens=1), 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_input_is_answered_then_serving_goes_on(server: RunningServer, path: str, body: dict,
                                                    status: int, param: str | None) -> None:
    with server.http() as http:
        response = http.post(path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and error["type"]
        if param is not None:
            assert error["param"] == param or error["param"].startswith(param + "."), error
        assert http.post(path, json=GOOD_CHAT if path == CHAT else GOOD_COMPLETION).status_code == 200


def test_an_image_part_is_refused_by_name(server: RunningServer) -> None:
    """A multimodal request says what is unsupported, not which literal the schema wanted."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with server.http() as http:
        response = http.post(CHAT, json=chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, image]}]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.1" and "'image_url'" in error["message"], error


def test_context_overflow_names_both_numbers(server: RunningServer) -> None:
    with server.http() as http:
        response = http.post(COMPLETIONS, json=completion(prompt=[1] * 200, max_tokens=100))
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in error["message"] and "300" in error["message"]


@pytest.mark.parametrize("path, body", [(CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "word " * 300}]}),
                                        (COMPLETIONS, completion(prompt=[1] * MAX_MODEL_LEN, max_tokens=5))])
def test_a_prompt_that_fills_the_context_is_named_alone(server: RunningServer, path: str, body: dict) -> None:
    """A prompt with no room left after it is the thing to shorten, whether max_tokens was sent or
    not: the message gives its length and doesn't ask to lower a max_tokens that can't help."""
    with server.http() as http:
        response = http.post(path, json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded", error
    assert str(MAX_MODEL_LEN) in error["message"] and "input tokens" in error["message"], error
    assert "max_tokens" not in error["message"] and "for the completion)" not in error["message"], error


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b'{"max_tokens": NaN}',
                                 b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                                 b"[" * 100_000])
def test_malformed_json_is_a_400(server: RunningServer, raw: bytes) -> None:
    with server.http() as http:
        response = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["type"]


def test_unknown_route_and_method_get_error_bodies(server: RunningServer) -> None:
    with server.http() as http:
        assert http.get("/v1/nothing").json()["error"]["message"]
        assert http.get(CHAT).status_code == 405


def test_body_too_large_is_a_413(tiny_engine) -> None:
    with serving(tiny_engine, ServerSettings(max_body_bytes=1000)) as small:
        big = json.dumps(chat(messages=[{"role": "user", "content": "x" * 2000}])).encode()
        with small.http() as http:
            declared = http.post(CHAT, content=big, headers={"content-type": "application/json"})
            assert declared.status_code == 413 and declared.json()["error"]["code"]

            def chunks():  # no Content-Length: the limit must hold while reading
                yield big[:600]
                yield big[600:]

            streamed = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
            assert streamed.status_code == 413
            assert http.post(CHAT, json=chat(model=None)).status_code == 200


def test_api_keys_are_required_when_set(tiny_engine) -> None:
    with serving(tiny_engine, ServerSettings(api_keys=("k1", "k2"))) as secured:
        with secured.http() as http:
            assert http.get("/health").status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
                response = http.get("/v1/models", headers=headers)
                assert response.status_code == 401 and response.json()["error"]["code"]
        for key in ("k1", "k2"):
            assert secured.client(api_key=key).models.list().data
        with pytest.raises(Exception) as raised:
            secured.client(api_key="nope").completions.create(model="x", prompt="hi")
        assert getattr(raised.value, "status_code", None) == 401


def test_not_ready_until_an_engine_is_attached(tiny_engine) -> None:
    with serving(None, ServerSettings()) as loading:
        with loading.http() as http:
            for response in (http.get("/health"), http.head("/health"),
                             http.post(COMPLETIONS, json=completion(model=None))):
                # Clients and load balancers wait Retry-After seconds before they ask again.
                assert response.status_code == 503 and int(response.headers["retry-after"]) > 0
            # Clients poll the model list until the server is up: 503, not a 500 (an assertion).
            for path in ("/v1/models", "/v1/models/tiny"):
                assert http.get(path).json()["error"]["code"] == "not_ready"
            loading.app.state.vivace.attach_engine(tiny_engine)
            assert http.get("/health").status_code == 200
            assert http.post(COMPLETIONS, json=completion(model=None)).status_code == 200


def test_the_model_path_given_names_the_model_unless_names_are_given(tiny_engine, tiny_model_dir: Path) -> None:
    # vLLM serves `vllm serve /models/X` as "/models/X": the same client code must reach vivace.
    given, resolved = tiny_engine.model_path, str(tiny_model_dir.resolve())
    with serving(tiny_engine, ServerSettings()) as by_path:
        client = by_path.client()
        assert [m.id for m in client.models.list().data] == [tiny_model_dir.resolve().name]
        for name in (given, resolved, tiny_model_dir.resolve().name):
            answer = client.completions.create(model=name, prompt="hi", max_tokens=1)
            assert answer.model == name and client.models.retrieve(name).id == name
    with serving(tiny_engine, ServerSettings(served_model_name="tiny")) as named, named.http() as http:
        for name in (given, resolved):
            refused = http.post(COMPLETIONS, json=completion(model=name))
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


def test_request_beyond_the_kv_pool_is_refused_whole_or_streamed(tiny_model_dir: Path) -> None:
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN,
                                      num_kv_blocks=4, block_size=16))
    try:
        with serving(engine, ServerSettings()) as small, small.http() as http:
            body = completion(model=None, max_tokens=100)
            whole = http.post(COMPLETIONS, json=body)
            assert whole.status_code == 400 and "KV" in whole.json()["error"]["message"]
            streamed = http.post(COMPLETIONS, json={**body, "stream": True})
            assert streamed.status_code == 400 and "KV" in streamed.json()["error"]["message"]
            assert http.post(COMPLETIONS, json=completion(model=None)).status_code == 200
        assert_engine_idle(engine)
    finally:
        engine.shutdown()
