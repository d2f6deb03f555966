"""Where a request's own work runs (``vivace.server.prompts``): big bodies are parsed, and
conversations with tools templated, in a worker thread, so the event loop keeps writing every
other stream's events; and the parse itself does no work per field of every object."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
from pydantic.fields import FieldInfo

from vivace.server import prompts
from vivace.server.protocol import ChatCompletionRequest

from .harness import RunningServer

LOOP_THREAD = "uvicorn-test"  # the event loop's thread in the test harness (harness.serving)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture
def work_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread that ran each piece of timed work (parsing, templating), in order."""
    threads: list[str] = []

    @contextlib.contextmanager
    def recorded(log: object) -> Iterator[None]:
        threads.append(threading.current_thread().name)
        yield
    monkeypatch.setattr(prompts, "timed", recorded)
    return threads


def test_a_big_body_is_parsed_off_the_event_loop(server: RunningServer, work_threads: list[str]) -> None:
    base = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with server.http() as http:
        assert http.post("/v1/chat/completions", json=base).status_code == 200
        assert work_threads[0] == LOOP_THREAD  # a small body costs less than the thread hop
        work_threads.clear()
        big = {**base, "stop": [f"{i:04d}" + "x" * 996 for i in range(300)]}  # 300 KB
        assert http.post("/v1/chat/completions", json=big).status_code == 200
    assert work_threads[0] != LOOP_THREAD


def test_tools_are_templated_off_the_event_loop(tools_server: RunningServer, work_threads: list[str]) -> None:
    """However short the messages, tools put their schemas into the prompt (1,000 tools held the
    loop ~115 ms); unless tool_choice is none, which leaves them out."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tools": [WEATHER]}
    with tools_server.http() as http:
        assert http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
        assert work_threads[1] == LOOP_THREAD
        work_threads.clear()
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert work_threads[0] == LOOP_THREAD and work_threads[1] != LOOP_THREAD  # parsed here, templated there


def test_nulls_are_given_defaults_without_a_pass_over_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only fields whose default is not None are looked at: a message has none (a 20,000-message
    body spent ~150 ms on the event loop setting each message's fields to the None they were)."""
    defaults: list[str] = []
    get_default = FieldInfo.get_default
    monkeypatch.setattr(FieldInfo, "get_default", lambda self, **kw: defaults.append(self) or get_default(self, **kw))
    body = ChatCompletionRequest.model_validate_json(
        '{"messages": [' + ", ".join(['{"role": "user", "content": "Hi"}'] * 1000) + '], "temperature": null, "n": null}')
    assert body.messages[999].name is None and body.temperature is None and body.n == 1
    assert len(defaults) < 30
