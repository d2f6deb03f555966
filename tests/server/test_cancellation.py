"""A client that goes away mid-answer: its request is aborted in the engine, the KV pool's
accounting holds (checked after every test), and /metrics shows nothing running."""

from __future__ import annotations

import httpx

from .conftest import MAX_MODEL_LEN
from .harness import RunningServer, metric_value, wait_until

LONG = {"model": "tiny", "prompt": "Go on and on", "max_tokens": MAX_MODEL_LEN - 16,
        "ignore_eos": True}


def aborted(server: RunningServer) -> float:
    return metric_value(server, "vivace:request_success_total", finished_reason="abort")


def assert_aborted_and_idle(server: RunningServer, aborts_before: float) -> None:
    wait_until(lambda: aborted(server) == aborts_before + 1, what="the abort to be counted")
    wait_until(lambda: metric_value(server, "vivace:num_requests_running") == 0,
               what="/metrics to show no running request")
    assert metric_value(server, "vivace:num_requests_waiting") == 0


def test_stream_closed_mid_answer_is_aborted(server: RunningServer) -> None:
    before = aborted(server)
    with server.http() as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            events = (line for line in response.iter_lines() if line.startswith("data:"))
            for _ in range(3):
                assert next(events) != "data: [DONE]"
    assert_aborted_and_idle(server, before)


def test_whole_answer_abandoned_is_aborted(server: RunningServer) -> None:
    before = aborted(server)
    with server.http() as http:
        try:
            http.post("/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=0.2))
        except httpx.ReadTimeout:
            pass
        else:
            raise AssertionError("the answer came before the client gave up; lengthen it")
    assert_aborted_and_idle(server, before)
