"""OpenTelemetry traces of requests, exported over OTLP (HTTP/protobuf, or gRPC) when the server is given
``--otlp-traces-endpoint``. Nothing here is imported otherwise, so tracing off costs nothing.

Each engine request becomes one ``llm_request`` span (vLLM's name), a child of the incoming W3C
``traceparent`` when there is one, carrying vLLM's and the GenAI semantic conventions'
``gen_ai.*`` attributes. Its ``queue``, ``prefill`` and ``decode`` phases are child spans;
preemptions and prefill chunks are events. Spans are built from the request's timings once it
has ended, on the event loop; the SDK's batch processor exports them from its own thread, so
neither the engine nor a request ever waits on the collector (an unreachable one is logged).
The standard ``OTEL_*`` variables apply: service name, resource attributes (a ``service.name``
there too), propagators, the sampler, exporter headers and timeout, batch sizes and delays,
``OTEL_SDK_DISABLED``, and the protocol: ``http/protobuf`` unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
(or ``OTEL_EXPORTER_OTLP_PROTOCOL``) says ``grpc``, which needs OpenTelemetry's gRPC exporter.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Status, StatusCode
from starlette.types import Receive, Scope, Send

from vivace.server.asgi import HTTPMiddleware

if TYPE_CHECKING:
    from fastapi import FastAPI

    from vivace.server.generation import EngineRequest

logger = logging.getLogger("vivace.server")

SPAN_NAME = "llm_request"
FLUSH_TIMEOUT_S = 3.0  # the most a stopping server waits for its last spans to reach the collector
_PROPAGATED = (b"traceparent", b"tracestate", b"baggage")
# The trace-context headers of the HTTP request being served, and its gen_ai.operation.name.
_incoming: ContextVar[tuple[Mapping[str, str], str]] = ContextVar("vivace_trace_context", default=({}, "chat"))


def operation_of(path: str) -> str:
    """The GenAI operation an API path serves: ``text_completion`` for /v1/completions, else ``chat``
    (chat completions, Anthropic's messages, responses)."""
    path = path.rstrip("/")
    return "text_completion" if path.endswith("/completions") and not path.endswith("/chat/completions") else "chat"


def trace_protocol() -> str:
    """The OTLP protocol the ``OTEL_*`` variables ask for (the traces' own first), as given."""
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()


def span_exporter(endpoint: str) -> SpanExporter:
    """An OTLP exporter to ``endpoint`` over :func:`trace_protocol`. Raises ValueError for a
    protocol it cannot speak (``http/json``, or ``grpc`` without OpenTelemetry's gRPC exporter)
    rather than sending protobuf over HTTP to a collector that expects something else."""
    protocol = trace_protocol()
    if protocol == "http/protobuf":
        return OTLPSpanExporter(traces_url(endpoint))
    if protocol != "grpc":
        raise ValueError(f"OTLP protocol {protocol!r} is not supported: use http/protobuf or grpc")
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    except ImportError:
        raise ValueError("OTLP over grpc needs OpenTelemetry's gRPC exporter: "
                         "pip install opentelemetry-exporter-otlp-proto-grpc") from None
    return GrpcExporter(endpoint)


def service_resource() -> Resource:
    """The resource of the ``OTEL_*`` variables, named ``vivace`` unless they name the service."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "vivace"}))
    return resource


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: a bare collector address gets ``/v1/traces``."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"the OTLP traces endpoint must be an http(s) URL, got {endpoint!r}")
    return endpoint if parts.path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


class _TraceHeaders(HTTPMiddleware):
    """ASGI middleware keeping the request's trace-context headers and operation for the span
    recorded when its engine request ends (that runs in a task spawned under this call, so it
    sees them)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope["headers"] if name in _PROPAGATED}
        token = _incoming.set((headers, operation_of(scope["path"])))
        try:
            await self.app(scope, receive, send)
        finally:
            _incoming.reset(token)


class RequestTracer:
    """Turns ended engine requests into spans exported to ``endpoint`` (see the module doc)."""

    def __init__(self, endpoint: str) -> None:
        self.provider = TracerProvider(resource=service_resource())
        self.provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint)))
        self.tracer = self.provider.get_tracer("vivace")

    def record(self, request: EngineRequest) -> None:
        """Emits the span of one ended ``request``; never raises (a failure is logged)."""
        try:
            self._record(request, *_incoming.get())
        except Exception:
            logger.exception("could not record the trace of %s", request.request_id)

    def _record(self, request: EngineRequest, headers: Mapping[str, str], operation: str) -> None:
        wall_now, perf_now = time.time_ns(), time.perf_counter()

        def ns(instant: float) -> int:
            return wall_now - int((perf_now - instant) * 1e9)

        out = request.last
        t = out.timings if out is not None else None
        start = ns(t.arrival) if t else wall_now
        finished = t.finished if t and t.finished is not None else perf_now  # now: aborted
        span = self.tracer.start_span(SPAN_NAME, context=propagate.extract(headers),
                                      kind=trace.SpanKind.SERVER, start_time=start,
                                      attributes=request_attributes(request, operation))
        if t is not None:
            phases = trace.set_span_in_context(span)
            first = t.first_token
            # Each phase runs until the next begins, the last one (where it was aborted) until the end.
            for name, begin, finish in (("queue", t.arrival, t.scheduled),
                                        ("prefill", t.scheduled, first),
                                        ("decode", first, None)):
                if begin is not None:
                    self.tracer.start_span(name, context=phases, start_time=ns(begin)).end(
                        ns(finished if finish is None else finish))
            for instant in t.preemptions:
                span.add_event("preempted", timestamp=ns(instant))
            for instant, tokens in t.prefill_chunks:
                span.add_event("prefill_chunk", {"tokens": tokens}, timestamp=ns(instant))
        if request.error is not None:
            span.set_status(Status(StatusCode.ERROR, request.error.message))
        span.end(ns(finished))

    def shutdown(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Exports what is pending and stops the exporter, waiting ``timeout_s`` at most: a
        collector that is down or doesn't answer delays the server's exit no longer (the SDK's
        own shutdown waits out every retry of every batch, up to 30 s); what is left is dropped."""
        flush = threading.Thread(target=self.provider.shutdown, name="vivace-trace-flush", daemon=True)
        flush.start()
        flush.join(timeout_s)
        if flush.is_alive():
            logger.warning("traces: the collector did not take the last spans within %.0f s; "
                           "they are dropped", timeout_s)


def request_attributes(request: EngineRequest, operation: str) -> dict[str, Any]:
    """The ``gen_ai.*`` attributes of one ended request of ``operation``, vLLM's names and the
    current ones."""
    params, out, model = request.params, request.last, request.model
    prompt, completion = len(request.prompt_ids), request.completion_tokens
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.id": request.request_id, "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_tokens or 0, "gen_ai.request.n": params.n,
        "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.top_k": params.top_k,
        "gen_ai.response.id": request.request_id, "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": [c.finish_reason or "abort" for c in request.choices],
        "gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": completion,
        "gen_ai.usage.prompt_tokens": prompt, "gen_ai.usage.completion_tokens": completion,
        "gen_ai.usage.num_sequences": params.n,
    }
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    if request.error is not None:  # the semantic conventions' name for why it failed
        attributes["error.type"] = request.error.code or str(request.error.status)
    if out is None:
        return attributes
    t = out.timings
    attributes["gen_ai.usage.cached_tokens"] = out.num_cached_tokens
    attributes["gen_ai.latency.time_in_queue"] = t.queue_time
    attributes["gen_ai.latency.time_in_model_prefill"] = t.prefill_time
    attributes["gen_ai.latency.time_in_model_decode"] = t.decode_time
    attributes["gen_ai.latency.time_in_model_inference"] = t.prefill_time + t.decode_time
    attributes["gen_ai.latency.num_preemptions"] = len(t.preemptions)
    if t.first_token is not None:
        attributes["gen_ai.latency.time_to_first_token"] = t.first_token - t.arrival
    if t.finished is not None:
        attributes["gen_ai.latency.e2e"] = t.finished - t.arrival
    return attributes


def install_tracing(app: FastAPI, endpoint: str) -> RequestTracer:
    """Traces every request of ``app`` to ``endpoint``; the tracer is kept on
    ``app.state.tracer`` (its owner calls ``shutdown``; process exit does it too)."""
    tracer = RequestTracer(endpoint)
    app.add_middleware(_TraceHeaders)
    app.state.vivace.metrics.listeners.append(tracer.record)
    app.state.tracer = tracer
    return tracer
