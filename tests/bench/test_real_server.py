"""`vivace bench` against a real `vivace serve` of a tiny random model on loopback."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from vivace.bench.load import LoadPlan
from vivace.bench.runner import BenchConfig, run_benchmark

pytestmark = pytest.mark.slow
READY_DEADLINE_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vivace_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `python -m vivace.cli serve` of the tiny model, ready (/health 200), stopped after."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [sys.executable, "-m", "vivace.cli", "serve", str(tiny_model_dir), "--port", str(port),
               "--served-model-name", "tiny", "--eager"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, log)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)


def wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_DEADLINE_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"server exited {process.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"server not ready after {READY_DEADLINE_S} s:\n{log.read_text()[-3000:]}")


def test_completions_with_exact_prompt_lengths(vivace_url: str, tiny_model_dir: Path) -> None:
    config = BenchConfig(base_url=vivace_url, input_len=24, output_len=8, tokenizer=str(tiny_model_dir),
                         num_requests=6, warmup=1, plan=LoadPlan(concurrency=3, max_requests=6, max_duration_s=120),
                         request_timeout_s=60, progress=False)
    outcome = asyncio.run(run_benchmark(config))
    summary = outcome.summary
    assert outcome.endpoint.model == "tiny"
    assert (summary.completed, summary.failed) == (6, 0), summary.errors
    assert outcome.endpoint.output_control in ("ignore_eos", "min_tokens")
    assert [result.prompt_tokens for result in outcome.results] == [24] * 6
    assert summary.prompt_token_mismatches == 0
    assert all(result.output_tokens == 8 for result in outcome.results)
    assert summary.ttft.count == 6 and summary.itl.count > 0


def test_multi_turn_chat(vivace_url: str, tiny_model_dir: Path) -> None:
    config = BenchConfig(base_url=vivace_url, api="chat", workload="multi-turn", turns=2, input_len=12,
                         output_len=4, tokenizer=str(tiny_model_dir), num_requests=4, warmup=0,
                         plan=LoadPlan(concurrency=2, max_requests=4, max_duration_s=120), request_timeout_s=60,
                         progress=False)
    outcome = asyncio.run(run_benchmark(config))
    assert (outcome.summary.completed, outcome.summary.failed) == (4, 0), outcome.summary.errors
    prompts = sorted(result.prompt_tokens for result in outcome.results)
    assert prompts[0] < prompts[-1]  # the second turn carries the first turn and its reply
