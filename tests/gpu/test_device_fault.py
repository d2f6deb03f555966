"""A CUDA error in a step, over HTTP: the streams of that step end with an error chunk, a plain
request with a 500, and the server turns unavailable (``/health`` 503, new requests 503) instead
of running more steps on a device whose every launch now fails. Where there is no GPU the fault
is raised by the runner itself (the CUDA runner under Triton's interpreter, whose launch raises
torch's CUDA error once armed); the rest is the real engine, server and client."""

from __future__ import annotations

import json
import threading

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace.config import EngineConfig  # noqa: E402
from vivace.engine.async_engine import AsyncEngine  # noqa: E402
from vivace.gpu.runner import CudaRunner  # noqa: E402
from vivace.models import load_model  # noqa: E402
from vivace.server import ServerSettings  # noqa: E402
from tests.server.harness import serving  # noqa: E402

from .conftest import DEVICE  # noqa: E402

FAULT = getattr(torch, "AcceleratorError", RuntimeError)


class FaultyRunner(CudaRunner):
    """A CUDA runner whose launches raise a CUDA error once ``armed`` is set."""

    armed = threading.Event()

    def launch(self, *args, **kwargs):
        if self.armed.is_set():
            raise FAULT("CUDA error: an illegal memory access was encountered")
        return super().launch(*args, **kwargs)

    def launch_next(self, *args, **kwargs):
        if self.armed.is_set():
            raise FAULT("CUDA error: an illegal memory access was encountered")
        return super().launch_next(*args, **kwargs)


def test_a_cuda_error_ends_its_requests_and_the_server_reports_unavailable(tiny_model_dir) -> None:
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=48, block_size=4,
                                      max_model_len=128, device="cpu"))
    with engine._lock:
        loaded = load_model(str(tiny_model_dir), torch.float32, device=DEVICE)
        engine.engine.runner = FaultyRunner(loaded, 48, 4, torch.float32, 128, device=DEVICE)
    first_token = threading.Event()
    events: list[dict] = []
    try:
        with serving(engine, ServerSettings(served_model_name="tiny")) as server:
            def stream() -> None:
                with server.http() as http, http.stream("POST", "/v1/completions", json={
                        "prompt": [5, 90, 31], "max_tokens": 100, "ignore_eos": True, "stream": True}) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))
                            first_token.set()

            reader = threading.Thread(target=stream)
            reader.start()
            assert first_token.wait(120), "the stream did not start"
            FaultyRunner.armed.set()
            reader.join(120)
            with server.http() as http:
                health = http.get("/health")
                late = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    finally:
        FaultyRunner.armed.clear()
        engine.shutdown()
    assert "illegal memory access" in events[-1]["error"]["message"]
    assert 0 < sum(len(e["choices"]) for e in events if "choices" in e) < 100
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    assert late.status_code == 503
    assert engine.engine.device_error is not None and not engine.is_running
