"""Helpers for server tests: a real uvicorn on a free loopback port in a background thread,
polling with deadlines, and the engine's idle-state checks."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import uvicorn
from fastapi import FastAPI

from vivace.cli import engine_config, parse_args
from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings, build_app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    app: FastAPI
    engine: AsyncEngine | None

    def client(self, api_key: str = "none", **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0,
                             timeout=60, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60)


@contextlib.contextmanager
def serving(engine: AsyncEngine | None, settings: ServerSettings) -> Iterator[RunningServer]:
    """Runs ``build_app(engine, settings)`` on a free port until the block exits."""
    port = free_port()
    app = build_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=5,
                                           **settings.uvicorn_tls()))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        scheme = "https" if settings.ssl_certfile else "http"
        yield RunningServer(f"{scheme}://127.0.0.1:{port}", app, engine)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def serving_own_engine(config: EngineConfig, settings: ServerSettings) -> Iterator[RunningServer]:
    """``serving`` an engine of its own, made from ``config`` and shut down when the block exits."""
    engine = AsyncEngine(config)
    try:
        with serving(engine, settings) as running:
            yield running
    finally:
        engine.shutdown()


@contextlib.contextmanager
def serving_command_line(model: Path | str, *flags: str) -> Iterator[RunningServer]:
    """The engine ``vivace serve MODEL --eager --max-model-len 128 --num-kv-blocks 64 FLAGS...``
    builds (its flags parsed as the command line parses them), served as "tiny" on a free port;
    it must be idle, every KV block free, when the block exits."""
    args = parse_args(["serve", str(model), "--eager", "--max-model-len", "128", "--num-kv-blocks", "64", *flags])
    with serving_own_engine(engine_config(args), ServerSettings(served_model_name="tiny")) as running:
        yield running
        assert running.engine is not None
        assert_engine_idle(running.engine)


def wait_until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Polls ``condition`` until it holds; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_engine_idle(engine: AsyncEngine) -> None:
    """The engine drains, every KV block is free, and the pool's accounting is intact."""
    def idle() -> bool:
        stats = engine.stats()
        return stats.num_running == 0 and stats.num_waiting == 0

    wait_until(idle, what="the engine to go idle")
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "a KV block leaked"


def metric_value(server: RunningServer, name: str, **labels: str) -> float:
    """The current value of one sample of the server's ``/metrics`` (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.http() as http:
        text = http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
