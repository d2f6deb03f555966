"""``benchmarks/mixed_attention.py`` on CPU at a tiny size (the GPU's minutes are too few to find a
broken benchmark there): both paths of a prompt step's attention run, and agree."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the benchmark launches the CUDA backend's kernels")

from .conftest import DEVICE  # noqa: E402

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "mixed_attention.py"


def test_mixed_attention_benchmark_runs_both_paths() -> None:
    spec = importlib.util.spec_from_file_location("vivace_mixed_attention_benchmark", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse(["--prompt", "20", "--decode-rows", "0", "2", "--context", "40", "--max-seqs", "3",
                        "--splits", "2", "--rounds", "3", "--device", DEVICE])
    rows = bench.measure(args)
    assert [r["decode_rows"] for r in rows] == [0, 2]
    assert all(r["max_diff"] < 2e-2 for r in rows)  # bf16 outputs, two summation orders
    bench.report(rows, args)
