"""One request never breaks another over HTTP: hostile sampling values beside live streams,
and a request whose logits go non-finite, end alone; every other stream ends whole."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterator

import pytest

from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings
from vivace.server.request_id import RequestIdLogFilter

from .harness import RunningServer, assert_engine_idle, serving

POISON = 1234  # a token id whose embedding row is NaN in the poisoned model
HOSTILE = [
    {"temperature": 1e-308}, {"top_p": 5e-324}, {"repetition_penalty": 1e-308, "temperature": 0.5},
    {"seed": 2**64 - 1, "n": 2, "temperature": 1.0}, {"seed": -(2**63)},
    {"temperature": 1e-300, "top_p": 1e-300, "top_k": 1, "min_p": 1.0},
]


def stream_tokens(server: RunningServer, body: dict, started: threading.Event | None = None) -> tuple[int, list[str], str | None]:
    """Streams a completion; returns (completion tokens, finish reasons, error message)."""
    reasons, usage, error = [], 0, None
    with server.http() as http, http.stream("POST", "/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if started is not None:
                started.set()
            if "error" in event:
                error = event["error"]["message"]
            for choice in event.get("choices", []):
                if choice.get("finish_reason"):
                    reasons.append(choice["finish_reason"])
            usage = (event.get("usage") or {}).get("completion_tokens", usage)
    return usage, reasons, error


def run_beside_streams(server: RunningServer, others: list[dict], max_tokens: int = 40) -> tuple[list, list]:
    """Four streams decode; once they have begun, ``others`` are sent. Returns both results."""
    results: list = [None] * 4
    started = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        results[i] = stream_tokens(server, {"prompt": f"Stream {i} says", "max_tokens": max_tokens,
                                            "temperature": 0.8, "ignore_eos": True}, started[i])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60), "a stream did not start"
    with server.http() as http:
        answers = [http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **o}) for o in others]
    for thread in threads:
        thread.join(120)
    return results, answers


def test_hostile_sampling_values_beside_four_streams(server: RunningServer):
    results, answers = run_beside_streams(server, [{**o, "logprobs": 5} for o in HOSTILE])
    for answer in answers:
        assert answer.status_code == 200, answer.text
        for choice in answer.json()["choices"]:
            assert all(math.isfinite(v) for v in choice["logprobs"]["token_logprobs"])
    assert results == [(40, ["length"], None)] * 4


def test_tiny_temperature_samples_greedily(server: RunningServer):
    with server.http() as http:
        greedy = http.post("/v1/completions", json={"prompt": "x y", "max_tokens": 6, "temperature": 0})
        tiny = http.post("/v1/completions", json={"prompt": "x y", "max_tokens": 6, "temperature": 1e-308})
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def poisoned_server(make_tiny_llama) -> Iterator[RunningServer]:
    engine = AsyncEngine(EngineConfig(model=str(make_tiny_llama(seed=3, tie_word_embeddings=False)),
                                      max_model_len=256, num_kv_blocks=128, max_num_seqs=16))
    engine.engine.loaded.model.embed_tokens.weight.data[POISON] = float("nan")
    with serving(engine, ServerSettings(served_model_name="tiny")) as running:
        yield running
    assert_engine_idle(engine)
    engine.shutdown()


def test_a_poisoned_request_fails_alone(poisoned_server: RunningServer, caplog: pytest.LogCaptureFixture):
    caplog.handler.addFilter(RequestIdLogFilter())
    poisoned = {"prompt": [5, 6, POISON, 7], "max_tokens": 4}
    with caplog.at_level(logging.WARNING, logger="vivace.server"):
        results, answers = run_beside_streams(poisoned_server, [poisoned])
        with poisoned_server.http() as http:
            whole = http.post("/v1/completions", json=poisoned, headers={"X-Request-Id": "poisoned-1"})
    streamed = stream_tokens(poisoned_server, poisoned)
    assert results == [(40, ["length"], None)] * 4
    assert answers[0].status_code == 500 and answers[0].json()["error"]["code"] == "request_failed"
    assert whole.status_code == 500 and "non-finite logits" in whole.json()["error"]["message"]
    assert streamed[2] is not None and "non-finite logits" in streamed[2]
    assert any(r.request_id == "poisoned-1" and "poisoned-1" in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def default_server() -> Iterator[RunningServer]:
    engine = AsyncEngine(EngineConfig(model="default", quantization="auto"))
    with serving(engine, ServerSettings()) as running:
        yield running
    assert_engine_idle(engine)
    engine.shutdown()


@pytest.mark.slow
def test_the_reported_requests_beside_four_streams_on_the_default_model(default_server: RunningServer):
    """The issue as reported: 1e-308 and 5e-324 beside four 200-token streams cut them all."""
    results, answers = run_beside_streams(default_server, [{"temperature": 1e-308}, {"top_p": 5e-324}],
                                          max_tokens=200)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert results == [(200, ["length"], None)] * 4
