"""One scaled-out server for the whole session: ``vivace serve --config`` in a subprocess,
starting its own local Ray cluster, serving tiny random models:

- ``tiny``: two replicas (prefix routing), the OpenAI conformance tests run against it;
- ``split``: versions ``a`` (weight 80) and ``b`` (20), and ``fast`` reserved for the
  ``premium`` tier; one replica each;
- ``auto``: one sequence at a time per replica, autoscaled 1 to 2 on queue depth with short
  delays.

Every request authenticates (the tier file has keys); the stop test ends the session's server,
and a later test starts it again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import transformers

from tests.server.conftest import MAX_MODEL_LEN
from tests.server.harness import RunningServer, free_port

REPO = Path(__file__).resolve().parents[2]
KEY, PREMIUM_KEY = "sk-default", "sk-premium"
START_TIMEOUT_S = 300
ENGINE = {"max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 128, "max_num_seqs": 32, "num_threads": 1}


def deployment_yaml(model: Path) -> str:
    engine = json.dumps({**ENGINE, "model": str(model)})
    single = json.dumps({**ENGINE, "model": str(model), "max_num_seqs": 1})
    return f"""
models:
  - name: tiny
    versions:
      - name: main
        replicas: 2
        engine: {engine}
  - name: split
    versions:
      - name: a
        weight: 80
        engine: {engine}
      - name: b
        weight: 20
        engine: {engine}
      - name: fast
        tiers: [premium]
        engine: {engine}
  - name: auto
    versions:
      - name: main
        min_replicas: 1
        max_replicas: 2
        target_ongoing_requests: 1
        upscale_delay: 1
        downscale_delay: 2
        engine: {single}
"""


def eventually(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls ``condition`` twice a second until it holds; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


class ClusterServer(RunningServer):
    """A RunningServer whose requests carry the default tier's key."""

    def client(self, api_key: str = KEY, **kwargs: object) -> openai.OpenAI:
        return super().client(api_key=api_key, **kwargs)

    def http(self, api_key: str = KEY) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60,
                            headers={"Authorization": f"Bearer {api_key}"})

    def replicas(self, model: str | None = None) -> list[dict]:
        with self.http() as http:
            rows = http.get("/replicas").json()["data"]
        return [r for r in rows if model is None or r["model"] == model]


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class BackgroundStream:
    """A streamed completion read in a thread: its headers, and its SSE data lines as they come."""

    def __init__(self, server: ClusterServer, body: dict) -> None:
        self.events: list[str] = []
        self.headers: dict[str, str] = {}
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(server, body))
        self.thread.start()

    def _read(self, server: ClusterServer, body: dict) -> None:
        with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
            self.headers.update(response.headers)
            for line in response.iter_lines():
                if line.startswith("data:"):
                    self.events.append(line)
                    self.started.set()

    def ended(self, timeout: float) -> bool:
        """Whether the stream ended within ``timeout`` seconds."""
        self.thread.join(timeout=timeout)
        return not self.thread.is_alive()


class Cluster:
    """The session's ``vivace serve --config`` process; :meth:`server` (re)starts it."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir = workdir
        self.config = workdir / "deployment.yaml"
        self.config.write_text(deployment_yaml(model))
        self.keys = workdir / "keys.json"
        self.keys.write_text(json.dumps({"tiers": {"premium": {"priority": 0}},
                                         "keys": {KEY: "default", PREMIUM_KEY: "premium"}}))
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        self.process: subprocess.Popen | None = None
        self.running: ClusterServer | None = None

    def server(self) -> ClusterServer:
        if self.running is None or self.process is None or self.process.poll() is not None:
            self.running = self.start()
        return self.running

    def launch(self) -> ClusterServer:
        """Starts ``vivace serve`` and returns at once (its server is not up yet)."""
        port = free_port()
        self.log = (self.workdir / f"serve-{port}.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vivace.cli", "serve", "--config", str(self.config),
             "--api-key-file", str(self.keys), "--port", str(port), "--eager",
             "--log-level", "warning"],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy(),
            start_new_session=True)  # its own process group, with the Ray processes it starts
        return ClusterServer(f"http://127.0.0.1:{port}", None, SimpleNamespace(tokenizer=self.tokenizer))

    def start(self) -> ClusterServer:
        server = self.launch()
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while not _healthy(server.base_url):
                assert self.process.poll() is None, f"vivace serve exited:\n{self.log_text()}"
                assert time.monotonic() < deadline, f"never healthy:\n{self.log_text()}"
                time.sleep(0.5)
        except AssertionError:
            self.stop()
            raise
        return server

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM to the server, then its exit status; past ``timeout``, SIGKILL to its whole
        process group (Ray's processes included)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise
        finally:
            self.running = None
            self.log.close()

    def log_text(self) -> str:
        if not self.log.closed:  # stop() closes it
            self.log.flush()
        return Path(self.log.name).read_text()[-4000:]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path_factory.mktemp("cluster"), tiny_model_dir)
    yield running
    if running.process is not None and running.process.poll() is None:
        running.stop()


@pytest.fixture
def server(cluster: Cluster) -> ClusterServer:
    return cluster.server()
