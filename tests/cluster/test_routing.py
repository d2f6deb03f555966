"""Routing seen from the API: a conversation stays on the replica that caches it, weights
split a model's traffic between its versions, a tier gets the version reserved for it, and
/health, /v1/models, /replicas and /metrics describe the whole application; structured output
is checked in the ingress and obeyed on the replicas."""

from __future__ import annotations

from collections import Counter
from typing import Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from .conftest import PREMIUM_KEY, ClusterServer

BLOCK_SIZE = 16


def chat(http: httpx.Client, model: str, messages: list[dict], max_tokens: int = 8) -> httpx.Response:
    response = http.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response


def test_health_models_and_replicas_cover_every_model(server: ClusterServer) -> None:
    with server.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {"tiny", "split", "auto"}
        per_engine = http.get("/debug/timings")  # the replicas' timings are in /metrics
        assert per_engine.status_code == 404 and "/metrics" in per_engine.json()["error"]["message"]
    unkeyed = httpx.get(f"{server.base_url}/replicas", timeout=60)  # as /debug/timings: keys only
    assert unkeyed.status_code == 401 and unkeyed.json()["error"]["type"] == "authentication_error"
    tiny = server.replicas("tiny")
    assert len(tiny) == 2 and len({r["pid"] for r in tiny}) == 2
    for row in tiny:
        assert row["state"] == "RUNNING" and row["version"] == "main"
        assert {"id", "running", "waiting", "kv_usage"} <= row.keys()


def test_a_conversation_stays_on_one_replica_and_reuses_its_cache(server: ClusterServer) -> None:
    messages: list[dict] = []
    replicas, usages = [], []
    with server.http() as http:
        for question in ("Tell me about lighthouses and their keepers.", "Why are they so tall?",
                         "And who keeps them now?"):
            messages.append({"role": "user", "content": question})
            response = chat(http, "tiny", messages)
            replicas.append(response.headers["x-vivace-replica"])
            assert response.headers["x-vivace-version"] == "main"
            body = response.json()
            usages.append(body["usage"])
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert len(set(replicas)) == 1, replicas
    for previous, usage in zip(usages, usages[1:]):
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= previous["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE > 0


def test_streams_carry_the_replica_and_version_headers(server: ClusterServer) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("data:")]
        ids = {r["id"] for r in server.replicas("tiny")}
        assert response.headers["x-vivace-replica"] in ids
        assert response.headers["x-vivace-version"] == "main"
    assert events[-1] == "data: [DONE]"


def test_weights_split_a_models_traffic_80_20(server: ClusterServer) -> None:
    with server.http() as http:
        versions = Counter(chat(http, "split", [{"role": "user", "content": f"q{i}"}], 1)
                           .headers["x-vivace-version"] for i in range(100))
    assert set(versions) == {"a", "b"}, versions
    assert 70 <= versions["a"] <= 90, versions


def test_a_tier_gets_the_version_reserved_for_it(server: ClusterServer) -> None:
    with server.http(PREMIUM_KEY) as http:
        versions = {chat(http, "split", [{"role": "user", "content": "hi"}], 1)
                    .headers["x-vivace-version"] for _ in range(4)}
    assert versions == {"fast"}


def samples(server: ClusterServer, name: str) -> list[tuple[dict, float]]:
    with server.http() as http:
        text = http.get("/metrics").text
    return [(s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]


def test_metrics_label_each_replica_and_count_routing(server: ClusterServer) -> None:
    with server.http() as http:
        for _ in range(2):
            chat(http, "tiny", [{"role": "user", "content": "Repeat after me: " + "word " * 40}], 2)
    ids = {r["id"] for r in server.replicas("tiny")}
    running = {s["replica"] for s, _ in samples(server, "vivace:num_requests_running")
               if s["model"] == "tiny" and s["version"] == "main"}
    assert running == ids
    steps = {s["replica"]: v for s, v in samples(server, "vivace:engine_step_seconds_count")
             if s["model"] == "tiny" and s["phase"] == "total"}
    assert set(steps) == ids and sum(steps.values()) >= 2  # each request took a step or more
    count = {(s["model"], s["version"]): v for s, v in samples(server, "vivace:replicas")}
    assert count[("tiny", "main")] == 2 and count[("split", "a")] == 1
    decisions = {s["outcome"]: v for s, v in samples(server, "vivace:routing_decisions_total")
                 if s["model"] == "tiny"}
    assert decisions["prefix_hit"] >= 1 and decisions["no_prefix"] >= 1


def test_tokenize_and_logit_bias_through_the_ingress(server: ClusterServer) -> None:
    tokenizer = server.engine.tokenizer  # the ingress tokenizes with its copy of the replicas' tokenizer
    chosen = tokenizer.encode(" castle", add_special_tokens=False)[0]
    with server.http() as http:
        tokens = http.post("/tokenize", json={"model": "split", "prompt": "Once upon a time"}).json()
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
        biased = http.post("/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 3,
                                                    "temperature": 0, "logit_bias": {str(chosen): 100}})
        outside = http.post("/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 1,
                                                     "logit_bias": {"99999999": 1}})
        unkeyed = http.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert tokens["tokens"] == tokenizer.encode("Once upon a time") and tokens["count"] == len(tokens["tokens"])
    assert text == {"prompt": "Once upon a time"}
    assert biased.json()["choices"][0]["text"] == tokenizer.decode([chosen] * 3)
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "logit_bias"
    assert unkeyed.status_code == 401


def test_responses_api_through_the_ingress(server: ClusterServer) -> None:
    body = {"model": "tiny", "input": "Once upon a time", "max_output_tokens": 3, "temperature": 0}
    with server.http() as http:
        whole = http.post("/v1/responses", json=body)
        chat_answer = chat(http, "tiny", [{"role": "user", "content": "Once upon a time"}], max_tokens=3)
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as stream:
            events = [line.removeprefix("event: ") for line in stream.iter_lines() if line.startswith("event: ")]
    assert whole.status_code == 200, whole.text
    assert whole.json()["output"][0]["content"][0]["text"] == chat_answer.json()["choices"][0]["message"]["content"]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")


class Pick(BaseModel):
    choice: Literal["left", "right"]


def test_structured_output_through_the_ingress(server: ClusterServer) -> None:
    """The ingress checks a grammar compiles, with its copy of the version's tokenizer: a schema
    that does is obeyed on the replica, one that does not is a 400 naming the field."""
    client = server.client()
    parsed = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Pick"}],
                                           response_format=Pick, max_tokens=20)
    assert isinstance(parsed.choices[0].message.parsed, Pick)
    choice = client.completions.create(model="split", prompt="Yes?", max_tokens=4,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    with server.http() as http:
        refused = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Pick"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "response_format.json_schema.schema"
