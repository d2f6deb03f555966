"""Every kernel launch of SmolLM2-135M's shape on the CUDA path (bf16 weights, bf16 and float8 KV,
decode batches to 4)
compiles for Hopper (sm_90) with the installed Triton and its ptxas, no GPU needed, within the
shared memory of a block and without spilled registers: what the interpreter tests cannot see
(``benchmarks/triton_sm90.py``, which also covers the larger presets and weight formats)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_sm90.py"


def test_the_launches_of_a_real_shape_compile_for_hopper(tmp_path) -> None:
    out = tmp_path / "launches.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--presets", "smollm2-135m", "--formats", "bf16",
                           "--models", "", "--kv-dtypes", "bfloat16,float8_e4m3fn", "--max-batch", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    kernels = {r["kernel"] for r in results}
    # Decode (split and combined), prefill, norms, rotary + KV write, activation, GEMV, sampler.
    assert {"kernels._decode_attention_kernel", "kernels._combine_splits_kernel", "kernels._prefill_attention_kernel",
            "kernels._rms_norm_kernel", "kernels._rotary_kv_write_kernel", "kernels._gated_activation_kernel",
            "kernels._gemv_kernel", "sampler._race_kernel"} <= kernels
    assert all("error" not in r and r["shared"] <= 232448 and r.get("local", 0) == 0 for r in results)
