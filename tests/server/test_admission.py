"""Admission control on a real server: rate limits are 429s with Retry-After that recover,
overload and queue delays are 503s, timeouts are 504s, and nothing leaks."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings
from vivace.server.tiers import Tier

from .conftest import LONG_RUN
from .harness import RunningServer, assert_engine_idle, metric_value, serving, wait_until

COMPLETIONS = "/v1/completions"
LONG = {"prompt": "Keep going", "max_tokens": 240, "ignore_eos": True, "stream": True}
TIERS = {"k-rpm": Tier("rpm", requests_per_minute=2), "k-tpm": Tier("tpm", tokens_per_minute=60),
         "k-one": Tier("one", max_concurrency=1), "k-hurry": Tier("hurry", max_queue_delay=0.2)}


class FakeClock:
    """The admission clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def tiered(engine: AsyncEngine, **settings: object) -> Iterator[tuple[RunningServer, FakeClock]]:
    """A server with the keys of TIERS (plus "k-plain") on a hand-moved admission clock; on
    exit every admission ticket must be released and the engine idle with its pool whole."""
    clock = FakeClock()
    settings = ServerSettings(api_keys=(*TIERS, "k-plain"), key_tiers=TIERS,
                              served_model_name="tiny", **settings)
    with serving(engine, settings) as server:
        admission = server.app.state.vivace.admission
        admission.clock = clock
        yield server, clock
        wait_until(lambda: not admission.live, what="every admission ticket to be released")
        assert all(usage.in_flight == 0 for usage in admission.keys.values())
    assert_engine_idle(engine)


def rejected(server: RunningServer, reason: str) -> float:
    return metric_value(server, "vivace:request_rejected_total", reason=reason)


def short_completion(client: openai.OpenAI, prompt: str | list[int] = "hi", max_tokens: int = 1) -> None:
    client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                              extra_body={"ignore_eos": True})


def test_requests_per_minute_429_with_retry_after_then_recovery(tiny_engine: AsyncEngine) -> None:
    with tiered(tiny_engine) as (server, clock):
        client = server.client(api_key="k-rpm")
        short_completion(client)
        short_completion(client)
        with pytest.raises(openai.RateLimitError) as raised:
            short_completion(client)
        assert raised.value.response.headers["retry-after"] == "30"  # 2 a minute: one per 30 s
        assert raised.value.code == "requests_per_minute"
        short_completion(server.client(api_key="k-plain"))  # other keys are not limited
        clock.now += 30
        short_completion(client)
        assert rejected(server, "requests_per_minute") == 1


def test_tokens_per_minute_charge_the_prompt_then_the_output(tiny_engine: AsyncEngine) -> None:
    with tiered(tiny_engine) as (server, clock):
        client = server.client(api_key="k-tpm")
        short_completion(client, prompt=[5, 6, 7], max_tokens=80)  # 60 - 3 - 80: 23 in debt
        with pytest.raises(openai.RateLimitError) as raised:
            short_completion(client, prompt=[5, 6, 7])
        assert raised.value.response.headers["retry-after"] == "26"  # 23 + 3 at one a second
        clock.now += 26
        short_completion(client, prompt=[5, 6, 7])
        assert rejected(server, "tokens_per_minute") == 1


def open_stream(stack: contextlib.ExitStack, http: httpx.Client, key: str = "k-plain",
                **body: object) -> Iterator[dict]:
    """A streamed completion, open until ``stack`` closes: its events, parsed, as they come.
    (Keep the iterator: dropping it closes the response, which aborts the request.)"""
    response = stack.enter_context(http.stream(
        "POST", COMPLETIONS, json={**LONG, **body}, headers={"Authorization": f"Bearer {key}"}))
    assert response.status_code == 200
    lines = response.iter_lines()
    stack.callback(lines.close)
    return (json.loads(line.removeprefix("data:")) for line in lines if line.startswith("data: {"))


def test_concurrency_limit_429_until_the_stream_ends(single_slot_engine: AsyncEngine) -> None:
    with tiered(single_slot_engine) as (server, _), server.http() as http:
        client = server.client(api_key="k-one")
        with contextlib.ExitStack() as stack:
            next(open_stream(stack, http, "k-one", max_tokens=LONG_RUN))
            with pytest.raises(openai.RateLimitError) as raised:
                short_completion(client)
            assert raised.value.code == "max_concurrency"
            assert raised.value.response.headers["retry-after"] == "1"
        usage = server.app.state.vivace.admission.keys["k-one"]
        wait_until(lambda: usage.in_flight == 0, what="the closed stream to release its slot")
        short_completion(client)


def test_overload_is_a_503_and_the_server_recovers(single_slot_engine: AsyncEngine) -> None:
    with tiered(single_slot_engine, max_waiting_requests=2) as (server, _), server.http() as http:
        admission = server.app.state.vivace.admission
        with contextlib.ExitStack() as stack:
            next(open_stream(stack, http, max_tokens=LONG_RUN))  # the engine's only slot
            for _ in range(2):
                open_stream(stack, http)
            wait_until(lambda: admission.num_waiting == 2, what="two requests to queue")
            refused = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1},
                                headers={"Authorization": "Bearer k-plain"})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "max_waiting_requests"
        wait_until(lambda: not admission.live, what="the closed streams to be released")
        short_completion(server.client(api_key="k-plain"))
        assert rejected(server, "max_waiting_requests") == 1


def test_a_tier_max_queue_delay_ends_a_queued_request_with_a_503(single_slot_engine: AsyncEngine) -> None:
    with tiered(single_slot_engine) as (server, _), server.http() as http:
        with contextlib.ExitStack() as stack:
            next(open_stream(stack, http, max_tokens=LONG_RUN))
            whole = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 4},
                              headers={"Authorization": "Bearer k-hurry"})
            assert whole.status_code == 503 and whole.headers["retry-after"] == "1"
            assert whole.json()["error"]["code"] == "queue_timeout"
            streamed = open_stream(stack, http, "k-hurry", max_tokens=4)
            assert next(streamed)["error"]["code"] == "queue_timeout"
        assert metric_value(server, "vivace:request_timeout_total", kind="queue") == 2


def test_request_timeout_ends_the_request_with_a_504(single_slot_engine: AsyncEngine) -> None:
    with tiered(single_slot_engine, request_timeout_s=0.3) as (server, _), server.http() as http:
        body = {**LONG, "max_tokens": LONG_RUN, "stream": False}
        whole = http.post(COMPLETIONS, json=body, headers={"Authorization": "Bearer k-plain"})
        assert whole.status_code == 504 and whole.json()["error"]["code"] == "request_timeout"
        with contextlib.ExitStack() as stack:
            events = list(open_stream(stack, http, max_tokens=LONG_RUN))
        assert events[-1]["error"]["code"] == "request_timeout"
        assert metric_value(server, "vivace:request_timeout_total", kind="request") == 2
