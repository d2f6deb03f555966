"""The published contract: /openapi.json and /docs agree with what the server does (strict
types, 405 with Allow, 415, an empty prompt), and request ids run through the whole path."""

from __future__ import annotations

import json

import pytest
from openapi_spec_validator import validate

from .harness import RunningServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_openapi_document_validates_and_documents_every_route(server: RunningServer):
    with server.http() as http:
        spec = http.get("/openapi.json").json()
        assert http.get("/docs").status_code == 200
    validate(spec)  # OpenAPI 3.1, raises on any error
    assert spec["openapi"].startswith("3.1")
    paths = spec["paths"]
    assert set(paths) >= {"/health", "/metrics", "/v1/models", CHAT, COMPLETIONS}
    for path in (CHAT, COMPLETIONS):
        operation = paths[path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert body.split("/")[-1] in spec["components"]["schemas"]
        assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("400", "401", "404", "405", "413", "415", "429", "503"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]["$ref"]
            assert error.endswith("/ErrorResponse")
    schemas = spec["components"]["schemas"]
    # The served model's limits are in the contract.
    assert schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 255
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[0]["minLength"] == 1
    assert prompt[2]["items"]["minimum"] == 0 and prompt[2]["items"]["maximum"] > 0  # token ids
    # Bounds are JSON Schema keywords, which tools like schemathesis read; pydantic's own names
    # for them ("ge", "lt"...) would be ignored, and the contract would allow what the server refuses.
    def keys(node):
        if isinstance(node, dict):
            yield from node
            for child in node.values():
                yield from keys(child)
        elif isinstance(node, list):
            for child in node:
                yield from keys(child)
    assert not {"ge", "gt", "le", "lt", "min_length", "max_length"} & set(keys(schemas))



def test_request_and_response_models_of_one_name_are_both_documented(server: RunningServer):
    """Chat's ``ToolCall`` is a request model (strict) and a response model: the first must not
    replace the second in the document, so an answer's tool calls are described as they come."""
    with server.http() as http:
        schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert "additionalProperties" not in schemas["ToolCall"]  # the answer's
    assert schemas["ToolCallParam"]["additionalProperties"] is False  # the request's, strict
    assert schemas["ChatMessage"]["properties"]["tool_calls"]["anyOf"][0]["items"]["$ref"].endswith("/ToolCallParam")
    refs = {node["$ref"].rsplit("/", 1)[1] for node in _nodes(schemas) if isinstance(node, dict) and "$ref" in node}
    assert refs <= set(schemas)


def _nodes(node):
    yield node
    for child in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
        yield from _nodes(child)


@pytest.mark.parametrize("prompt", [[-190968], [1, 10**9]])
def test_token_ids_outside_the_vocabulary_are_400(server: RunningServer, prompt: list[int]):
    with server.http() as http:
        response = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("prompt")
    assert "valid string" not in response.json()["error"]["message"]


@pytest.mark.parametrize("stop_token_ids", [[-288], [2, 1292940]])
def test_stop_token_ids_outside_the_vocabulary_are_400(server: RunningServer, stop_token_ids: list[int]):
    # Found by fuzzing: with min_tokens, out-of-range stop ids indexed past the logits (a 500).
    with server.http() as http:
        response = http.post(CHAT, json={**GOOD_CHAT, "stop_token_ids": stop_token_ids, "min_tokens": 2})
    assert response.status_code == 400, response.text
    assert "stop_token_ids" in response.json()["error"]["message"] + (response.json()["error"]["param"] or "")
    with server.http() as http:
        schema = http.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
    ids = schema["properties"]["stop_token_ids"]["anyOf"][0]["items"]
    assert ids["minimum"] == 0 and ids["maximum"] < 1292940


@pytest.mark.parametrize("change", [{"stream": "yes"}, {"max_tokens": "2"}, {"max_tokens": 2.5},
                                    {"temperature": "0.5"}, {"logprobs": 1}, {"n": True}])
def test_values_of_the_wrong_json_type_are_400(server: RunningServer, change: dict):
    with server.http() as http:
        response = http.post(CHAT, json={**GOOD_CHAT, **change})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == next(iter(change))


def test_integral_floats_are_integers_as_in_json_schema(server: RunningServer):
    with server.http() as http:
        response = http.post(COMPLETIONS, json={"prompt": [1100.0, 1891], "max_tokens": 2.0, "n": 1.0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 2


def test_a_body_that_is_not_json_is_415_and_malformed_json_400(server: RunningServer):
    with server.http() as http:
        form = http.post(COMPLETIONS, content=b"prompt=hi", headers={"Content-Type": "application/x-www-form-urlencoded"})
        broken = http.post(COMPLETIONS, content=b"{not json", headers={"Content-Type": "application/json"})
        charset = http.post(COMPLETIONS, content=json.dumps({"prompt": "hi", "max_tokens": 1}),
                            headers={"Content-Type": "application/json; charset=utf-8"})
    assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
    assert charset.status_code == 200


def test_wrong_method_is_405_with_allow(server: RunningServer):
    with server.http() as http:
        response = http.put(CHAT, json=GOOD_CHAT)
        models = http.delete("/v1/models")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert models.status_code == 405 and models.headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/models/tiny", "/version", "/metrics"])
def test_head_is_answered_as_get_without_the_body(server: RunningServer, path: str):
    with server.http() as http:
        got, head = http.get(path), http.head(path)
    assert head.status_code == got.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    assert int(head.headers["content-length"]) > 0 and head.headers["x-request-id"]


def test_an_empty_prompt_is_refused_as_the_schema_says(server: RunningServer):
    with server.http() as http:
        response = http.post(COMPLETIONS, json={"prompt": "", "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_request_ids_run_through_body_header_and_stream(server: RunningServer):
    with server.http() as http:
        given = http.post(CHAT, json=GOOD_CHAT, headers={"X-Request-Id": "trace-42.a"})
        made = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1})
        again = http.post(CHAT, json=GOOD_CHAT, headers={"X-Request-Id": "trace-42.a"})
        bad = http.post(CHAT, json=GOOD_CHAT, headers={"X-Request-Id": "no spaces allowed"})
        with http.stream("POST", CHAT, json={**GOOD_CHAT, "stream": True},
                         headers={"X-Request-Id": "stream-7"}) as stream:
            ids = {json.loads(line[6:])["id"] for line in stream.iter_lines()
                   if line.startswith("data: {")}
            header = stream.headers["x-request-id"]
        error = http.post(CHAT, json={**GOOD_CHAT, "n": 0}, headers={"X-Request-Id": "bad-1"})
    assert given.json()["id"] == given.headers["x-request-id"] == "trace-42.a"
    assert again.status_code == 200  # a reused id is the client's business, not a clash
    assert made.json()["id"] == made.headers["x-request-id"] and made.json()["id"].startswith("cmpl-")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
    assert ids == {"stream-7"} and header == "stream-7"
    assert error.status_code == 400 and error.headers["x-request-id"] == "bad-1"
