"""What ``make serve`` runs: ``python -m vivace.cli serve`` with the default model answers
/health and a completion, drains an in-flight stream on SIGTERM, and exits 0."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from .harness import free_port

REPO = Path(__file__).resolve().parents[2]


def wait_healthy(base_url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited during start-up"
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server never became healthy")


def stream_text(base_url: str, out: list[str]) -> None:
    body = {"prompt": "Count to twenty:", "max_tokens": 24, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        out.extend(line for line in response.iter_lines() if line.startswith("data:"))


def sigterm_mid_stream(process: subprocess.Popen, stream: Callable[[], None], events: list[str]) -> threading.Thread:
    """Run ``stream`` in a thread and SIGTERM ``process`` once ``events`` has its first line."""
    streamer = threading.Thread(target=stream)
    streamer.start()
    deadline = time.monotonic() + 60
    while not events:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    return streamer


@pytest.mark.slow
def test_serve_default_model_then_sigterm_drains_and_exits_zero(tmp_path: Path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vivace.cli", "serve", "--port", str(port)], cwd=REPO,
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VIVACE_LOG_LEVEL": "warning"})
    try:
        wait_healthy(base_url, process)
        reply = httpx.post(f"{base_url}/v1/completions", timeout=120,
                           json={"prompt": "The capital of France is", "max_tokens": 5})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
        events: list[str] = []
        streamer = sigterm_mid_stream(process, lambda: stream_text(base_url, events), events)
        assert process.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        streamer.join(timeout=10)
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    finally:
        if process.poll() is None:
            process.kill()
        log.close()


@pytest.mark.slow
def test_sigterm_past_the_grace_ends_open_streams_with_an_error_event(tmp_path: Path, make_tiny_llama) -> None:
    """A stream still running when --shutdown-timeout runs out gets an error event and [DONE],
    not a connection cut mid-chunk, and the process still exits 0."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vivace.cli", "serve", str(make_tiny_llama(max_position_embeddings=1 << 16)),
         "--port", str(port), "--eager", "--shutdown-timeout", "1", "--num-kv-blocks", "4200"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "VIVACE_LOG_LEVEL": "warning"})
    try:
        wait_healthy(base_url, process)
        events: list[str] = []
        body = {"prompt": "Count:", "max_tokens": 60_000, "stream": True, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
                events.extend(line for line in response.iter_lines() if line.startswith("data:"))

        streamer = sigterm_mid_stream(process, stream, events)
        assert process.wait(timeout=30) == 0, (tmp_path / "serve.log").read_text()
        streamer.join(timeout=10)
        assert not streamer.is_alive()
        assert events[-1] == "data: [DONE]" and '"code":"engine_dead"' in events[-2], events[-2:]
    finally:
        if process.poll() is None:
            process.kill()
        log.close()


def _lower_open_files_limit(soft: int) -> Callable[[], None]:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return lower


async def _held_connections(port: int, count: int) -> list[bytes]:
    """Open ``count`` connections, all at once, ask /v1/models on each and return the status
    lines, keeping every connection open until all have answered."""
    streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]
    try:
        for _, writer in streams:
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: vivace\r\n\r\n")
        return [await asyncio.wait_for(reader.readline(), 60) for reader, _ in streams]
    finally:
        for _, writer in streams:
            writer.close()


@pytest.mark.slow
def test_serve_raises_a_low_open_files_limit_so_many_clients_connect(tmp_path: Path, make_tiny_llama) -> None:
    """Started under a soft limit of 128 open files (a distribution's default is 1024), the
    server raises it, as vLLM does, and answers 300 clients connected at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard limit of open files here is {hard}")
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vivace.cli", "serve", str(make_tiny_llama()), "--port", str(port), "--eager"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_lower_open_files_limit(128),
        env={**os.environ, "VIVACE_LOG_LEVEL": "warning"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        limits = Path(f"/proc/{process.pid}/limits").read_text()
        served_soft = int(next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3])
        assert served_soft == min(65535, hard if hard != resource.RLIM_INFINITY else 65535)
        status_lines = asyncio.run(_held_connections(port, 300))
        assert status_lines == [b"HTTP/1.1 200 OK\r\n"] * 300
    finally:
        process.kill()
        process.wait(timeout=30)
        log.close()
