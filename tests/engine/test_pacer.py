"""The pacer on synthetic step costs (no clocks): the cost model finds the costs, the budget
follows them and the targets, and on a real engine the pacer changes no greedy token while
``max_prefill_chunk`` still fixes the chunk."""

from __future__ import annotations

import random

import pytest

from vivace.config import EngineConfig
from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.llm_engine import LLMEngine
from vivace.engine.pacer import (
    MIN_PROMPT_TOKENS, Pacer, PacerTargets, StepCostModel, pacer_for, prompt_budget, prompt_kilopositions)
from vivace.engine.request import Request, RequestStatus
from vivace.engine.sampling_params import SamplingParams
from vivace.engine.scheduler import Scheduler

# A step: 4 ms, plus 0.25 ms per decode token, plus 0.05 ms per prompt token (and nothing for
# the prompt tokens' positions, unless a test says so).
COSTS = (0.004, 0.00025, 0.00005, 0.0)


def cost(decode_tokens: int, prompt_tokens: int, costs: tuple[float, ...] = COSTS, start: int = 0) -> float:
    kpos = prompt_kilopositions(start, prompt_tokens)
    return costs[0] + costs[1] * decode_tokens + costs[2] * prompt_tokens + costs[3] * kpos


def trained(costs: tuple[float, ...] = COSTS, steps: int = 200, seed: int = 0) -> StepCostModel:
    """A model fed ``steps`` steps of random shapes costing exactly ``costs``."""
    model, rng = StepCostModel(), random.Random(seed)
    for _ in range(steps):
        decode, prompt, start = rng.randrange(1, 33), rng.choice([0, 0, rng.randrange(1, 129)]), rng.randrange(0, 4000)
        model.observe(decode, prompt, prompt_kilopositions(start, prompt), cost(decode, prompt, costs, start))
    return model


def test_the_cost_model_finds_linear_step_costs() -> None:
    model = trained()
    assert model.warm
    assert model.coefficients == pytest.approx(COSTS, rel=0.02, abs=2e-6)
    assert model.predict(16, 100, prompt_kilopositions(500, 100)) == pytest.approx(cost(16, 100), rel=0.01)


def test_the_cost_model_is_cold_until_it_has_seen_both_kinds_of_step() -> None:
    model = StepCostModel()
    for _ in range(50):
        model.observe(8, 0, 0.0, cost(8, 0))
    assert not model.warm  # decode-only steps say nothing about a prompt token's cost
    for _ in range(8):
        model.observe(8, 16, prompt_kilopositions(0, 16), cost(8, 16))
    assert model.warm


def test_the_cost_model_follows_a_change_of_costs() -> None:
    model = trained()
    slower = tuple(2 * c for c in COSTS)  # e.g. a neighbour now shares the cores
    rng = random.Random(1)
    for _ in range(2000):
        decode, prompt = rng.randrange(1, 33), rng.choice([0, rng.randrange(1, 129)])
        model.observe(decode, prompt, 0.0, cost(decode, prompt, slower))
    assert model.predict(8, 64, prompt_kilopositions(0, 64)) == pytest.approx(cost(8, 64, slower), rel=0.05)


def test_one_stalled_step_barely_moves_a_warm_model() -> None:
    model = trained()
    before = model.predict(8, 32, prompt_kilopositions(0, 32))
    model.observe(8, 32, prompt_kilopositions(0, 32), 100 * cost(8, 32))  # counts as a 3-fold one
    assert model.predict(8, 32, prompt_kilopositions(0, 32)) < 1.1 * before


def test_nothing_decoding_gets_the_whole_budget_and_a_cold_model_the_minimum() -> None:
    assert prompt_budget(trained(), PacerTargets(), 0, 512, 0.0) == 512
    assert prompt_budget(StepCostModel(), PacerTargets(), 8, 512, 0.0) == MIN_PROMPT_TOKENS
    assert prompt_budget(StepCostModel(), PacerTargets(), 8, 10, 0.0) == 10


def test_the_budget_fills_the_room_under_the_itl_target() -> None:
    model = trained()
    decode_step = model.predict(8)  # about 6 ms
    budget = prompt_budget(model, PacerTargets(itl=decode_step + 0.005), 8, 512, 0.0)
    assert budget == pytest.approx(0.005 / COSTS[2], abs=2)  # 5 ms of room at 0.05 ms a token
    assert cost(8, budget) <= decode_step + 0.005 + 1e-4
    assert model.prompt_tokens_within(0.005, 0) == pytest.approx(budget, abs=1)
    # Default target: twice the decode step, so the room is one decode step.
    assert prompt_budget(model, PacerTargets(), 8, 512, 0.0) == pytest.approx(decode_step / COSTS[2], abs=2)
    # A slower prompt token buys fewer tokens for the same room.
    dearer = trained((COSTS[0], COSTS[1], 2 * COSTS[2], 0.0))
    assert prompt_budget(dearer, PacerTargets(itl=decode_step + 0.005), 8, 512, 0.0) == pytest.approx(50, abs=2)


def test_chunks_deeper_into_their_prompt_get_fewer_tokens() -> None:
    costs = (*COSTS[:3], 0.0001)  # 0.1 ms per thousand positions: attention over the prompt so far
    model = trained(costs)
    assert model.coefficients[3] == pytest.approx(0.0001, rel=0.05)
    target = PacerTargets(itl=model.predict(8) + 0.005)
    budgets = [prompt_budget(model, target, 8, 512, 0.0, prompt_start=start) for start in (0, 1000, 2000)]
    assert budgets[0] > budgets[1] > budgets[2]
    for start, budget in zip((0, 1000, 2000), budgets):  # the most that fits, to a token
        assert cost(8, budget, costs, start) <= target.itl + 1e-5 < cost(8, budget + 2, costs, start)


def test_a_target_tighter_than_the_decode_step_still_feeds_prompts_the_minimum() -> None:
    assert prompt_budget(trained(), PacerTargets(itl=0.001), 8, 512, 0.0) == MIN_PROMPT_TOKENS


def test_the_compiled_step_caps_the_budget_until_a_prompt_is_overdue() -> None:
    model = trained()
    targets = PacerTargets(itl=0.02, ttft=1.0)
    uncapped = prompt_budget(model, targets, 8, 512, 0.0)
    assert uncapped > 56
    assert prompt_budget(model, targets, 8, 512, 0.5, compiled_rows=64) == 56
    overdue = prompt_budget(model, targets, 8, 512, 1.5, compiled_rows=64)
    assert overdue == min(512, 2 * uncapped) or overdue == pytest.approx(2 * uncapped, abs=2)


def test_the_budget_always_stays_within_its_bounds() -> None:
    rng = random.Random(3)
    for seed in range(5):
        model = trained(steps=rng.randrange(0, 60), seed=seed)
        for _ in range(200):
            decode, step_budget = rng.randrange(0, 64), rng.randrange(1, 600)
            targets = PacerTargets(itl=rng.choice([None, rng.uniform(0.001, 0.05)]),
                                   ttft=rng.choice([None, 0.5]))
            budget = prompt_budget(model, targets, decode, step_budget, rng.uniform(0, 1),
                                   rng.choice([0, 64]))
            assert min(MIN_PROMPT_TOKENS, step_budget) <= budget <= step_budget


def test_the_pacer_learns_only_from_steps_its_model_describes() -> None:
    pacer = Pacer(PacerTargets(), compiled_rows=64)
    pacer.observe(0, 300, 45.0, 0.5)  # prompt only: the prefill path
    pacer.observe(8, 100, 5.0, 0.5)  # past the compiled rows: an eager step
    assert pacer.model.num_decode_only == pacer.model.num_with_prompt == 0
    pacer.observe(8, 16, prompt_kilopositions(0, 16), cost(8, 16))
    assert pacer.model.num_with_prompt == 1


def test_a_fixed_chunk_turns_the_pacer_off() -> None:
    assert pacer_for(EngineConfig(max_prefill_chunk=16), 64) is None
    pacer = pacer_for(EngineConfig(itl_target_ms=25, ttft_target_ms=800), 64)
    assert pacer.targets == PacerTargets(itl=0.025, ttft=0.8)
    assert pacer.compiled_rows == 64


def running_request(kv: KVCacheManager, request_id: str, prompt_len: int, computed: int) -> Request:
    request = Request(request_id, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=8))
    assert kv.allocate_slots(request, computed)
    request.num_computed_tokens = computed
    request.status = RequestStatus.RUNNING
    return request


def test_the_scheduler_gives_a_prompt_what_the_pacer_budgets() -> None:
    kv = KVCacheManager(num_blocks=256, block_size=4, enable_prefix_caching=False)
    pacer = Pacer(PacerTargets(itl=0.0085), model=trained())  # room: 8.5 - 6 ms = 50 tokens
    scheduler = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=512, pacer=pacer)
    streams = [running_request(kv, f"s{i}", 4, 4) for i in range(8)]
    for stream in streams:
        stream.token_ids.append(7)  # it has sampled: it decodes now
    scheduler.running.extend(streams)
    scheduler.add(Request("long", list(range(3, 1003)), SamplingParams(max_tokens=1)))
    batch = scheduler.schedule()
    assert batch.num_decode_tokens == 8
    assert batch.prompt_budget == pytest.approx(50, abs=2)
    assert batch.num_prompt_tokens == batch.prompt_budget


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4))


def stream_then_prompts(engine: LLMEngine) -> dict[str, list[int]]:
    """Greedy tokens of 3 streams decoding while two 60-token prompts arrive."""
    rng = random.Random(5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"s{i}", [rng.randrange(3, 49152) for _ in range(5)], params)
    tokens: dict[str, list[int]] = {}
    for step in range(60):
        if step in (3, 10):
            engine.add_request(f"p{step}", [rng.randrange(3, 49152) for _ in range(60)], params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return tokens


def test_greedy_outputs_are_identical_with_the_pacer_and_a_fixed_chunk(tiny: LLMEngine) -> None:
    paced = LLMEngine(tiny.config, tiny.loaded)
    paced.scheduler.pacer.model = trained((0.004, 0.00025, 0.0002, 0.0))  # budgets of ~20-30 tokens
    fixed = LLMEngine(EngineConfig(model=tiny.config.model, num_kv_blocks=256, block_size=4,
                                   max_prefill_chunk=3), tiny.loaded)
    assert stream_then_prompts(paced) == stream_then_prompts(fixed)
    paced_prompts = {s["prompt_tokens"] for s in paced.timings.steps.rows() if s["decode_tokens"]}
    fixed_prompts = {s["prompt_tokens"] for s in fixed.timings.steps.rows() if s["decode_tokens"]}
    assert max(fixed_prompts) == 3  # the fixed chunk holds while streams decode
    assert max(paced_prompts) > 3
    for engine in (paced, fixed):
        engine.check_integrity()
        assert engine.kv.num_free_blocks == len(engine.kv.blocks)
