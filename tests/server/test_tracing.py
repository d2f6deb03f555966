"""OpenTelemetry traces: spans sent over OTLP/HTTP to a real receiver on loopback, one
``llm_request`` per request with the gen_ai.* attributes, parented to an incoming traceparent,
with queue/prefill/decode children; a dead collector costs no request."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings
from vivace.server.tracing import RequestTracer, traces_url

from .conftest import LONG_RUN
from .harness import RunningServer, free_port, serving, wait_until
from .otlp_receiver import Received, attributes, otlp_receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def traced(tiny_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[tuple[RunningServer, Received]]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vivace-test")
    with otlp_receiver() as (url, received):
        settings = ServerSettings(served_model_name="tiny", otlp_traces_endpoint=url)
        with serving(tiny_engine, settings) as server:
            yield server, received
            server.app.state.tracer.shutdown()


def _only(received: Received, name: str) -> Span:
    wait_until(lambda: len(received.named(name)) >= 1, what=f"a {name} span")
    spans = received.named(name)
    assert len(spans) == 1, [s.name for s in received.spans]
    return spans[0]


def test_a_request_is_one_span_continuing_the_callers_trace(traced) -> None:
    server, received = traced
    reply = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0.5,
        top_p=0.9, extra_body={"ignore_eos": True, "top_k": 20},
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    span = _only(received, "llm_request")
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert span.kind == Span.SPAN_KIND_SERVER
    assert received.content_types[0] == "application/x-protobuf"
    assert received.services[0] == "vivace-test"
    attrs = attributes(span)
    prompt = reply.usage.prompt_tokens
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "tiny"
    assert attrs["gen_ai.request.id"] == attrs["gen_ai.response.id"] == reply.id
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.n"]) == (5, 1)
    assert (attrs["gen_ai.request.temperature"], attrs["gen_ai.request.top_p"]) == (0.5, 0.9)
    assert attrs["gen_ai.request.top_k"] == 20
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.usage.input_tokens"] == attrs["gen_ai.usage.prompt_tokens"] == prompt
    assert attrs["gen_ai.usage.output_tokens"] == attrs["gen_ai.usage.completion_tokens"] == 5
    latency = {k.removeprefix("gen_ai.latency."): v for k, v in attrs.items() if "latency" in k}
    assert 0 <= latency["time_in_queue"] < latency["time_to_first_token"] <= latency["e2e"]
    assert latency["time_in_model_prefill"] > 0 and latency["time_in_model_decode"] > 0
    assert latency["time_in_model_inference"] == pytest.approx(
        latency["time_in_model_prefill"] + latency["time_in_model_decode"])
    assert attrs["gen_ai.usage.num_sequences"] == 1
    assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(latency["e2e"] * 1e9, rel=1e-3)
    assert abs(span.start_time_unix_nano / 1e9 - time.time()) < 60
    chunks = [e for e in span.events if e.name == "prefill_chunk"]
    computed = prompt - attrs["gen_ai.usage.cached_tokens"]  # type: ignore[operator]
    assert sum(attributes(e)["tokens"] for e in chunks) == computed  # type: ignore[misc]


def test_phases_are_child_spans_in_order(traced) -> None:
    server, received = traced
    stream = server.client().completions.create(model="tiny", prompt="one two three", max_tokens=3,
                                                stream=True, extra_body={"ignore_eos": True})
    assert len([chunk for chunk in stream if chunk.choices]) == 3
    wait_until(lambda: len(received.spans) >= 4, what="the request's four spans")
    request = _only(received, "llm_request")
    assert len(request.parent_span_id) == 0  # no traceparent came: a new trace
    phases = {name: _only(received, name) for name in ("queue", "prefill", "decode")}
    for phase in phases.values():
        assert phase.trace_id == request.trace_id and phase.parent_span_id == request.span_id
    assert request.start_time_unix_nano == phases["queue"].start_time_unix_nano
    assert phases["queue"].end_time_unix_nano == phases["prefill"].start_time_unix_nano
    assert phases["prefill"].end_time_unix_nano == phases["decode"].start_time_unix_nano
    assert phases["decode"].end_time_unix_nano == request.end_time_unix_nano
    assert attributes(request)["gen_ai.operation.name"] == "text_completion"


def test_the_operation_is_the_routes_whatever_the_request_id(traced) -> None:
    server, received = traced
    message = {"role": "user", "content": "hi"}
    server.client().chat.completions.create(model="tiny", messages=[message], max_tokens=2,
                                            extra_headers={"X-Request-Id": "gateway-42"})
    with server.http() as http:
        assert http.post("/v1/messages", json={"model": "tiny", "max_tokens": 2,
                                               "messages": [message]}).status_code == 200
    server.client().completions.create(model="tiny", prompt="x", max_tokens=2,
                                       extra_headers={"X-Request-Id": "chatcmpl-lookalike"})
    wait_until(lambda: len(received.named("llm_request")) == 3, what="three spans")
    spans = [attributes(span) for span in received.named("llm_request")]
    operations = {re.split("[-_]", str(a["gen_ai.request.id"]))[0]: a["gen_ai.operation.name"] for a in spans}
    assert operations == {"gateway": "chat", "msg": "chat", "chatcmpl": "text_completion"}


def test_the_span_names_the_model_the_response_does(tiny_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with otlp_receiver() as (url, received), serving(tiny_engine, ServerSettings(otlp_traces_endpoint=url)) as server:
        client = server.client()
        by_path = client.completions.create(model=tiny_engine.model_path, prompt="x", max_tokens=1)
        by_name = client.chat.completions.create(model=tiny_engine.model_name, max_tokens=1,
                                                 messages=[{"role": "user", "content": "hi"}])
        wait_until(lambda: len(received.named("llm_request")) == 2, what="two spans")
        server.app.state.tracer.shutdown()
    models = {a["gen_ai.request.id"]: (a["gen_ai.request.model"], a["gen_ai.response.model"])
              for a in map(attributes, received.named("llm_request"))}
    assert models == {f"{by_path.id}-0": (by_path.model, by_path.model), by_name.id: (by_name.model, by_name.model)}
    assert by_path.model == tiny_engine.model_path != by_name.model


def test_a_failed_request_is_an_error_span(single_slot_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with otlp_receiver() as (url, received):
        settings = ServerSettings(served_model_name="tiny", otlp_traces_endpoint=url, request_timeout_s=0.3)
        with serving(single_slot_engine, settings) as server, server.http() as http:
            body = {"prompt": "Keep going", "max_tokens": LONG_RUN, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 504
            span = _only(received, "llm_request")
            server.app.state.tracer.shutdown()
    assert span.status.code == span.status.STATUS_CODE_ERROR and "timeout" in span.status.message
    attrs = attributes(span)
    assert attrs["error.type"] == "request_timeout" and attrs["gen_ai.response.finish_reasons"] == ["abort"]


def test_a_stream_the_client_leaves_ends_its_phases_where_it_was_aborted(
        single_slot_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    body = {"prompt": "Keep going", "max_tokens": LONG_RUN, "ignore_eos": True, "stream": True}
    with otlp_receiver() as (url, received):
        with serving(single_slot_engine, ServerSettings(otlp_traces_endpoint=url)) as server, server.http() as http:
            with http.stream("POST", "/v1/completions", json=body) as stream:
                next(line for i, line in enumerate(stream.iter_lines()) if i > 10)
            wait_until(lambda: len(received.spans) == 4, what="the request's four spans")
            server.app.state.tracer.shutdown()
    request, decode = _only(received, "llm_request"), _only(received, "decode")
    assert attributes(request)["gen_ai.response.finish_reasons"] == ["abort"]
    assert decode.parent_span_id == request.span_id
    assert decode.start_time_unix_nano < decode.end_time_unix_nano == request.end_time_unix_nano


@pytest.mark.parametrize("collector", ["down", "silent"])
def test_an_unreachable_collector_costs_no_request_nor_a_slow_exit(
        tiny_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, collector: str) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes connections, never answers
        port = free_port() if collector == "down" else silent.getsockname()[1]
        settings = ServerSettings(served_model_name="tiny", otlp_traces_endpoint=f"http://127.0.0.1:{port}")
        with serving(tiny_engine, settings) as server:
            for _ in range(3):
                started = time.monotonic()
                reply = server.client().completions.create(model="tiny", prompt="x", max_tokens=2)
                assert reply.choices[0].text is not None and time.monotonic() - started < 5
            started = time.monotonic()
            server.app.state.tracer.shutdown(timeout_s=0.5)  # the SDK's own waits out its 10 s export timeout
            assert time.monotonic() - started < 3


def test_traces_url_appends_the_otlp_path_to_a_bare_address() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/custom/path") == "https://c.example/custom/path"
    with pytest.raises(ValueError, match="http"):
        traces_url("collector:4317")


def test_the_service_is_named_by_otel_variables_else_vivace(monkeypatch: pytest.MonkeyPatch) -> None:
    def service() -> dict[str, object]:
        tracer = RequestTracer(f"http://127.0.0.1:{free_port()}")
        tracer.shutdown()
        return dict(tracer.provider.resource.attributes)

    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert service()["service.name"] == "vivace"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=chat-api,deployment.environment=prod")
    assert (service()["service.name"], service()["deployment.environment"]) == ("chat-api", "prod")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "wins")
    assert service()["service.name"] == "wins"


def test_an_otlp_protocol_it_cannot_speak_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        RequestTracer(endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # the traces' own wins
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="opentelemetry-exporter-otlp-proto-grpc"):
            RequestTracer(endpoint)
    else:
        RequestTracer(endpoint).shutdown()


def test_without_tracing_opentelemetry_sdk_is_never_imported() -> None:
    code = ("import sys; from vivace.server import build_app, ServerSettings; "
            "build_app(None, ServerSettings()); "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
