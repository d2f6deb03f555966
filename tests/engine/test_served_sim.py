"""``benchmarks/served_sim.py``'s simulated CUDA runner stays a runner the engine can drive: the
engine over it overlaps decode steps, plans prompt steps with the graph buckets, and every request
gets its tokens, on a virtual device that costs the measured H200 step times (so it keeps in step
with ``CudaRunner``'s seam as that changes)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from vivace.engine import backend
from vivace.engine.llm import LLM
from vivace.engine.sampling_params import SamplingParams

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def served_sim():
    pytest.importorskip("triton", reason="the CUDA runner's module needs triton")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("served_sim", BENCHMARKS / "served_sim.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_engine_serves_a_batch_over_the_simulated_runner(served_sim, tiny_model_dir, monkeypatch) -> None:
    def make_runner(config, loaded, num_blocks, max_model_len, loaded_from_config=False):
        return served_sim.SimulatedRunner(loaded, num_blocks, config.block_size, 8, config.max_num_seqs,
                                          max_model_len, eager=False)

    monkeypatch.setattr(backend, "make_runner", make_runner)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4, max_num_seqs=8)
    engine = llm.engine
    assert engine.scheduler.pacer.fill_eager and engine.scheduler.pacer.token_buckets == (16, 32, 64, 128, 256, 512)
    start = time.perf_counter()
    outputs = llm.generate([list(range(3, 3 + n)) for n in (40, 300, 7, 400, 12, 260)],
                           SamplingParams(max_tokens=20, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [20] * 6
    steps = engine.timings.steps.rows()
    assert any(s["prompt_tokens"] and s["decode_tokens"] for s in steps)  # prompts rode beside decodes
    # at least the virtual device's time: ~20 decode steps of 5 ms or more
    assert time.perf_counter() - start >= 20 * served_sim.pacer_sim.decode_ms(1) / 1e3
    engine.check_integrity()
