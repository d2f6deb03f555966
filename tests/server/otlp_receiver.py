"""A real OTLP/HTTP trace receiver on loopback: decodes each protobuf export request the way a
collector does and keeps the spans it carried."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass
class Received:
    """What the receiver got: spans, their service names, and the requests' content types."""

    spans: list[Span] = field(default_factory=list)
    services: list[str] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [span for span in self.spans if span.name == name]


def value_of(value: AnyValue) -> object:
    """A protobuf attribute value as Python: scalars, and lists of them."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind)


def attributes(span: Span) -> dict[str, object]:
    return {kv.key: value_of(kv.value) for kv in span.attributes}


def _handler(received: Received) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            export = ExportTraceServiceRequest.FromString(body)
            with received.lock:
                received.content_types.append(self.headers["Content-Type"])
                for resource_spans in export.resource_spans:
                    service = {kv.key: value_of(kv.value) for kv in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        received.spans.extend(scope_spans.spans)
                        received.services.extend([str(service.get("service.name"))] * len(scope_spans.spans))
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[str, Received]]:
    """Yields (the receiver's base URL, what it has received so far)."""
    received = Received()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(received))
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
