"""The overlap scheduler over the CUDA runner (on CPU under Triton's interpreter where there is no
GPU): a decode step queued before the previous one's tokens are read, its input ids taken on the
device, gives the same tokens as steps taken one at a time; a request that stops (eos, a stop
token, max_tokens) or is aborted while the next step is queued sends nothing past its stop and
gives back every block."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace import LLM, SamplingParams  # noqa: E402
from vivace.gpu.runner import CudaRunner  # noqa: E402
from vivace.models import load_model  # noqa: E402

from .conftest import DEVICE  # noqa: E402

PROMPTS = [[5, 90, 31, 242, 77, 12, 5, 90], [8, 100, 200, 7], [9, 9, 41]]
BLOCKS = 48


def engine_llm(model_dir: str, overlap: bool) -> LLM:
    """An LLM over a CudaRunner on DEVICE, counting the steps it launched ahead."""
    llm = LLM(model_dir, num_kv_blocks=BLOCKS, block_size=4, max_model_len=64, device="cpu",
              overlap_schedule=overlap)
    engine = llm.engine
    loaded = load_model(model_dir, torch.float32, device=DEVICE)
    runner = CudaRunner(loaded, BLOCKS, 4, torch.float32, engine.max_model_len, device=DEVICE)
    runner.launched_ahead = 0
    launch_next = runner.launch_next

    def counted(*args, **kwargs):
        runner.launched_ahead += 1
        return launch_next(*args, **kwargs)

    runner.launch_next = counted
    engine.runner = runner
    return llm


@pytest.fixture(scope="module")
def pair(tiny_model_dir) -> tuple[LLM, LLM]:
    return engine_llm(str(tiny_model_dir), overlap=False), engine_llm(str(tiny_model_dir), overlap=True)


def outputs(llm: LLM, prompts, params) -> list:
    result = [o.outputs[0] for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == BLOCKS and not llm.engine.has_unfinished()
    return result


def test_greedy_seeded_and_min_tokens_equal_one_step_at_a_time(pair) -> None:
    serial, overlapped = pair
    # Lengths that differ: the batch shrinks while steps are queued ahead of it.
    params = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=4, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=11, max_tokens=6, min_tokens=5, logprobs=1)]
    want = outputs(serial, PROMPTS, params)
    before = overlapped.engine.runner.launched_ahead
    decode_only = overlapped.engine.scheduler.pacer.model.num_decode_only
    got = outputs(overlapped, PROMPTS, params)
    ahead = overlapped.engine.runner.launched_ahead - before
    assert ahead > 0  # steps did go ahead, and the pacer learned from each
    assert overlapped.engine.scheduler.pacer.model.num_decode_only - decode_only >= ahead
    assert serial.engine.runner.launched_ahead == 0
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert [lp.token_id for lp in a.logprobs or []] == [lp.token_id for lp in b.logprobs or []]
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert abs(x.logprob - y.logprob) < 1e-4 and [t for t, _, _ in x.top] == [t for t, _, _ in y.top]


def test_nothing_past_a_stop_token_is_sent(pair) -> None:
    serial, overlapped = pair
    free = outputs(serial, PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    stop = free[2]  # the third token stops it, while the fourth is already queued
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    want = outputs(serial, PROMPTS[0], params)[0]
    got = outputs(overlapped, PROMPTS[0], params)[0]
    assert got.token_ids == want.token_ids == free[:free.index(stop) + 1]
    assert got.finish_reason == "stop"


def test_an_abort_while_a_step_is_queued_spares_the_others(pair) -> None:
    serial, overlapped = pair
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = outputs(serial, PROMPTS[1], params)[0].token_ids
    engine = overlapped.engine
    engine.add_request("stays", PROMPTS[1], params)
    engine.add_request("goes", PROMPTS[0], params)
    tokens: dict[str, list[int]] = {"stays": [], "goes": []}
    steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.outputs[0].token_ids
        steps += 1
        if steps == 3:
            assert engine._inflight is not None  # the next step is queued
            engine.abort_request("goes")
            aborted_at = len(tokens["goes"])
    assert tokens["stays"] == want and len(tokens["goes"]) == aborted_at
    engine.check_integrity()
    assert engine.kv.num_free_blocks == BLOCKS
