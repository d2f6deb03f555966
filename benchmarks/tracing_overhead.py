"""Inter-token latency with OpenTelemetry tracing off and on, in one run.

    python benchmarks/tracing_overhead.py [--model default] [--rounds 20] [--input-len 128]
        [--output-len 128] [--threads N] [--eager] [--quantization auto|none|int8|int4]

One engine serves two apps on loopback: one without tracing, one exporting a span per request
over OTLP/HTTP to a local sink (which counts what it receives, so the spans really travel).
Each round sends one streamed request to each app, one at a time, in alternating order, so
both see the same engine, warm-up and machine load. Prints mean/median/p99 ITL and median
TTFT per arm (milliseconds, client side) and the traced arm's difference in percent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import uvicorn
from fastapi import FastAPI

from vivace.bench.client import Endpoint, RequestResult, stream_request
from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings, build_app


class _Sink(BaseHTTPRequestHandler):
    exports = 0
    bytes = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).exports += 1
        type(self).bytes += len(body)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _thread(target: object, name: str) -> Iterator[None]:
    thread = threading.Thread(target=target, name=name, daemon=True)  # type: ignore[arg-type]
    thread.start()
    yield
    thread.join(timeout=30)


@contextmanager
def _served(engine: AsyncEngine, settings: ServerSettings) -> Iterator[tuple[str, FastAPI]]:
    app, port = build_app(engine, settings), _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    with _thread(server.run, f"uvicorn-{port}"):
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}", app
        server.should_exit = True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _rounds(urls: dict[str, str], args: argparse.Namespace) -> dict[str, list[RequestResult]]:
    results: dict[str, list[RequestResult]] = {arm: [] for arm in urls}
    async with httpx.AsyncClient(timeout=300) as client:
        for i in range(args.rounds + 1):  # round 0 warms both arms up and is not counted
            order = list(urls) if i % 2 == 0 else list(urls)[::-1]
            for arm in order:
                prompt = " ".join(f"w{i}x{j}" for j in range(args.input_len // 3))
                endpoint = Endpoint(urls[arm], "completions", "bench")
                result = await stream_request(client, endpoint, prompt, args.output_len, 0.0)
                if result.error:
                    raise RuntimeError(f"{arm}: {result.error_kind}: {result.error}")
                if i:
                    results[arm].append(result)
                    print(f"round {i} {arm}: mean ITL {statistics.fmean(result.itl) * 1e3:.2f} ms",
                          flush=True)
    return results


def _summary(results: list[RequestResult]) -> dict[str, float]:
    gaps = sorted(g * 1e3 for r in results for g in r.itl)
    return {"mean ITL": statistics.fmean(gaps), "median ITL": statistics.median(gaps),
            "p99 ITL": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "median TTFT": statistics.median(r.ttft * 1e3 for r in results if r.ttft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--quantization", default="auto")
    args = parser.parse_args()
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")
    engine = AsyncEngine(EngineConfig(model=args.model, num_threads=args.threads,
                                      compile=not args.eager, quantization=args.quantization))
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    sink_url = f"http://127.0.0.1:{sink.server_address[1]}"
    try:
        with _thread(sink.serve_forever, "otlp-sink"), \
                _served(engine, ServerSettings(served_model_name="bench")) as (off, _), \
                _served(engine, ServerSettings(served_model_name="bench",
                                               otlp_traces_endpoint=sink_url)) as (on, traced):
            results = asyncio.run(_rounds({"off": off, "on": on}, args))
            traced.state.tracer.shutdown()  # exports what is pending, so the sink's count is complete
            sink.shutdown()
    finally:
        engine.shutdown()
    summaries = {arm: _summary(r) for arm, r in results.items()}
    print(f"{args.rounds} rounds, {args.input_len}-word prompts, {args.output_len} tokens out; "
          f"OTLP sink got {_Sink.exports} exports, {_Sink.bytes} bytes")
    print(f"| figure (ms) | tracing off | tracing on | on vs off |\n|---|---|---|---|")
    for figure, off_value in summaries["off"].items():
        on_value = summaries["on"][figure]
        print(f"| {figure} | {off_value:.2f} | {on_value:.2f} | {100 * (on_value / off_value - 1):+.1f} % |")


if __name__ == "__main__":
    main()
