"""``benchmarks/gpu.py``'s llama-batched-bench rows, on CPU at a tiny size (the GPU's minutes are
too few to find a broken benchmark there): every stream gets its tokens, counted once, and the
rates follow from the phases."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GPU_BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def test_batched_bench_rows_on_cpu(monkeypatch) -> None:
    pytest.importorskip("triton", reason="benchmarks/gpu.py imports the CUDA backend's modules")
    spec = importlib.util.spec_from_file_location("vivace_gpu_benchmark", GPU_BENCHMARK)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    rows = gpu.batched_bench("smollm2-135m", [2, 3], prompt=40, new_tokens=5, device="cpu")
    assert [r["streams"] for r in rows] == [2, 3]
    for r in rows:
        assert r["tokens"] == 5 * r["streams"]  # every output token of every stream, counted once
        assert r["t_pp_s"] > 0 and r["t_tg_s"] > 0 and r["s_pp"] == pytest.approx(r["streams"] * 40 / r["t_pp_s"])
        assert 0 < r["s_tg"] and r["s"] > 0
