"""The pacer on synthetic step costs (no clocks): the cost model finds the costs, the plan
follows them, the targets and the paths, and on a real engine the pacer changes no greedy token
while ``max_prefill_chunk`` still fixes the chunk."""

from __future__ import annotations

import random

import pytest

from vivace.config import EngineConfig
from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.llm_engine import LLMEngine
from vivace.engine.pacer import (
    COLD_PROMPT_TOKENS, DEEP_MIN_PROMPT_TOKENS, DEEP_PROMPT_START, LONG_RUN_ROWS, MIN_PROMPT_TOKENS, Pacer, PacerTargets, PromptPath, PromptPlan, StepCostModel, pacer_for, plan_prompt,
    prompt_kilopositions)
from vivace.engine.request import Request, RequestStatus
from vivace.engine.sampling_params import SamplingParams
from vivace.engine.scheduler import Scheduler

ROWS, PREFILL = PromptPath.ROWS, PromptPath.PREFILL
# A step: 4 ms, plus 0.25 ms per decode token; a prompt row 0.05 ms (and nothing for its
# position, in short runs or long, unless a test says so); the prefill path 20 ms more, plus
# 0.04 ms a token and 0.001 ms per thousand positions.
COSTS = (0.004, 0.00025, 0.00005, 0.0, 0.0, 0.02, 0.00004, 0.000001)
# Rows at 0.3 ms, plus 0.7 ms per thousand positions when fewer than 16 (read row by row), 0.2 ms
# in a run of 16 or more; the prefill path 20 ms, plus 0.2 ms a token and 0.01 ms per thousand.
DEEP_COSTS = (0.004, 0.00025, 0.0003, 0.0007, 0.0002, 0.02, 0.0002, 0.00001)


def cost(decode_tokens: int, prompt_tokens: int, costs: tuple[float, ...] = COSTS, start: int = 0,
         path: PromptPath = ROWS) -> float:
    kpos = prompt_kilopositions(start, prompt_tokens)
    prompt = costs[2] * prompt_tokens + costs[4 if prompt_tokens >= LONG_RUN_ROWS else 3] * kpos
    if path is PREFILL:
        prompt = costs[5] + costs[6] * prompt_tokens + costs[7] * kpos
    return costs[0] + costs[1] * decode_tokens + prompt


def trained(costs: tuple[float, ...] = COSTS, steps: int = 300, seed: int = 0) -> StepCostModel:
    """A model fed ``steps`` steps of random shapes and paths costing exactly ``costs``."""
    model, rng = StepCostModel(), random.Random(seed)
    for _ in range(steps):
        decode, prompt, start = rng.randrange(1, 33), rng.choice([0, 0, rng.randrange(1, 129)]), rng.randrange(0, 4000)
        path = rng.choice([ROWS, PREFILL]) if prompt else ROWS
        if path is PREFILL and rng.random() < 0.3:
            decode = 0  # a step of prompts alone
        model.observe(decode, prompt, prompt_kilopositions(start, prompt), cost(decode, prompt, costs, start, path), path)
    return model


def fixed_model(costs: tuple[float, ...]) -> StepCostModel:
    """A warm model that keeps ``costs`` whatever real steps it is then shown."""
    model = StepCostModel(costs, prior_weight=1e12)
    for prompt in [0] * 8 + [16] * 8:
        model.observe(8, prompt, prompt_kilopositions(0, prompt), cost(8, prompt, costs))
    return model


def test_the_cost_model_finds_linear_step_costs_on_both_paths() -> None:
    model = trained()
    assert model.warm
    assert model.coefficients[:3] == pytest.approx(COSTS[:3], rel=0.03)
    assert model.coefficients[3:5] == pytest.approx(COSTS[3:5], abs=1e-5)  # per thousand positions
    # The prefill path's overhead and per-token cost trade off against each other (and the
    # prior pulls at both) over the steps seen; their predictions hold.
    for path in (ROWS, PREFILL):
        for decode, prompt, start in ((16, 100, 500), (8, 16, 3000), (0, 128, 0)):
            assert model.predict(decode, prompt, prompt_kilopositions(start, prompt), path) == pytest.approx(
                cost(decode, prompt, start=start, path=path), rel=0.08)


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


def test_nothing_decoding_gets_the_whole_budget_and_a_cold_model_the_cold_chunk() -> None:
    assert plan_prompt(trained(), PacerTargets(), 0, 512, 0.0) == PromptPlan(512, PREFILL)
    assert plan_prompt(StepCostModel(), PacerTargets(), 8, 512, 0.0, 64) == PromptPlan(COLD_PROMPT_TOKENS, ROWS)
    assert plan_prompt(StepCostModel(), PacerTargets(), 8, 10, 0.0, 64) == PromptPlan(10, ROWS)
    # Without a compiled step, every chunk beside decodes runs the prefill path.
    assert plan_prompt(StepCostModel(), PacerTargets(), 8, 512, 0.0) == PromptPlan(COLD_PROMPT_TOKENS, PREFILL)


def test_the_budget_fills_the_room_under_the_itl_target() -> None:
    model = trained()
    decode_step = model.predict(8)  # about 6 ms
    plan = plan_prompt(model, PacerTargets(itl=decode_step + 0.005), 8, 512, 0.0, 512)
    assert plan.path is ROWS  # 5 ms of room: less than the prefill path's overhead
    assert plan.tokens == pytest.approx(0.005 / COSTS[2], abs=2)  # 5 ms at 0.05 ms a row
    assert cost(8, plan.tokens) <= decode_step + 0.005 + 1e-4
    assert model.prompt_tokens_within(0.005, 0) == pytest.approx(plan.tokens, abs=1)
    # Default target: twice the decode step, so the room is one decode step.
    assert plan_prompt(model, PacerTargets(), 8, 512, 0.0, 512).tokens == pytest.approx(decode_step / COSTS[2], rel=0.03)
    # A slower prompt row buys fewer rows for the same room.
    dearer = trained((COSTS[0], COSTS[1], 2 * COSTS[2], *COSTS[3:]))
    assert plan_prompt(dearer, PacerTargets(itl=decode_step + 0.005), 8, 512, 0.0, 512).tokens == pytest.approx(
        50, abs=2)


def test_chunks_deeper_into_their_prompt_get_fewer_rows() -> None:
    costs = (*COSTS[:3], 0.0001, 0.0001, *COSTS[5:])  # 0.1 ms per thousand positions: a row reads the prompt so far
    model = trained(costs)
    assert model.coefficients[3:5] == pytest.approx([0.0001, 0.0001], rel=0.05)
    target = PacerTargets(itl=model.predict(8) + 0.005)
    plans = [plan_prompt(model, target, 8, 512, 0.0, 512, start) for start in (0, 1000, 2000)]
    assert [p.path for p in plans] == [ROWS] * 3
    assert plans[0].tokens > plans[1].tokens > plans[2].tokens
    for start, plan in zip((0, 1000, 2000), plans):  # the most that fits, to a token
        assert cost(8, plan.tokens, costs, start) <= target.itl + 1e-5 < cost(8, plan.tokens + 2, costs, start)


def test_a_deep_chunk_takes_the_prefill_path_when_it_fits_more_tokens() -> None:
    costs = DEEP_COSTS
    model = trained(costs)
    target = PacerTargets(itl=0.035)  # 29 ms of room beside 8 decodes
    shallow = plan_prompt(model, target, 8, 512, 0.0, 64, prompt_start=0)
    deep = plan_prompt(model, target, 8, 512, 0.0, 64, prompt_start=4000)
    assert shallow == PromptPlan(56, ROWS)  # all the compiled step's rows fit
    assert deep.path is PREFILL
    assert deep.tokens > model.prompt_tokens_within(0.035 - model.predict(8), 4000, ROWS)
    assert cost(8, deep.tokens, costs, 4000, PREFILL) == pytest.approx(0.035, rel=0.05)  # the fit's error


def test_runs_of_16_rows_or_more_are_costed_apart_from_shorter_ones() -> None:
    model = trained(DEEP_COSTS)
    assert model.coefficients[3:5] == pytest.approx(DEEP_COSTS[3:5], rel=0.05)
    # 3,000 tokens in, a row costs 2.4 ms in a short run, 0.9 ms in a long one: 29 ms of room
    # holds a long run of 32 rows (a short one would be 12).
    assert model.prompt_tokens_within(0.029, 3000) == pytest.approx(32, abs=1)
    # 10 ms holds no long run (11 rows): a short one, of 4.
    assert model.prompt_tokens_within(0.010, 3000) == 4
    for tokens in (4, 15, 16, 32):  # the prediction takes a chunk's rows as one run
        kpos = prompt_kilopositions(3000, tokens)
        assert model.predict(8, tokens, kpos) == pytest.approx(cost(8, tokens, DEEP_COSTS, 3000), rel=0.02)
    # A step of two chunks is told which of its positions were in long runs.
    short, long = prompt_kilopositions(3000, 4), prompt_kilopositions(1000, 16)
    before = model.predict(8, 20, short + long)
    seconds = cost(8, 4, DEEP_COSTS, 3000) + cost(8, 16, DEEP_COSTS, 1000) - DEEP_COSTS[0] - 8 * DEEP_COSTS[1]
    for _ in range(50):
        model.observe(8, 20, short + long, seconds, ROWS, long_run_kpos=long)
    assert model.coefficients[3:5] == pytest.approx(DEEP_COSTS[3:5], rel=0.05)  # unmoved: the split was right
    assert before != pytest.approx(seconds, rel=0.05)  # as one run, the same step would be mispredicted


def test_a_vanishing_depth_cost_leaves_the_room_to_the_per_token_cost() -> None:
    # A fitted depth coefficient of ~1e-31 (noise around zero) once cancelled the quadratic's root
    # to 0 tokens, or to a handful, at random.
    for per_kpos in (0.0, 1e-31, 6e-31, 1e-12):
        model = fixed_model((0.004, 0.00025, 0.0001, per_kpos, per_kpos, 0.001, 0.00005, per_kpos))
        assert model.prompt_tokens_within(0.00425, 12) == 42
        assert model.prompt_tokens_within(0.00425, 12, PREFILL) == pytest.approx(65, abs=1)  # 3.25 ms at 0.05


def test_a_target_tighter_than_the_decode_step_still_moves_prompts_on_the_cheaper_path() -> None:
    assert plan_prompt(trained(), PacerTargets(itl=0.001), 8, 512, 0.0, 64) == PromptPlan(MIN_PROMPT_TOKENS, ROWS)
    # 40,000 tokens in, 16 rows (a long run: 0.3 + 0.2 x 40 ms each) cost 133 ms; on the prefill path 30 ms.
    deep = trained(DEEP_COSTS)
    assert plan_prompt(deep, PacerTargets(itl=0.001), 8, 512, 0.0, 64, 40000) == PromptPlan(DEEP_MIN_PROMPT_TOKENS,
                                                                                          PREFILL)
    # 3,000 tokens in, the same 16 rows cost 14.4 ms, less than the prefill path's 23.7: rows. Priced
    # at the short runs' 0.7 ms per thousand positions they would have seemed to cost 38 ms.
    assert plan_prompt(deep, PacerTargets(itl=0.001), 8, 512, 0.0, 64, 3000) == PromptPlan(DEEP_MIN_PROMPT_TOKENS,
                                                                                         ROWS)


def test_deep_into_a_prompt_the_floor_is_a_run_the_prefill_kernel_takes() -> None:
    model, tight = trained(), PacerTargets(itl=0.001)
    shallow = plan_prompt(model, tight, 8, 512, 0.0, 64, DEEP_PROMPT_START - 1)
    deep = plan_prompt(model, tight, 8, 512, 0.0, 64, DEEP_PROMPT_START)
    assert (shallow.tokens, deep.tokens) == (MIN_PROMPT_TOKENS, DEEP_MIN_PROMPT_TOKENS)
    assert plan_prompt(model, tight, 8, 10, 0.0, 64, DEEP_PROMPT_START).tokens == 10  # never past the step's budget


def test_an_overdue_prompt_gets_twice_the_room() -> None:
    model = trained()
    targets = PacerTargets(itl=0.06, ttft=1.0)
    on_time = plan_prompt(model, targets, 8, 2048, 0.5, 64)
    overdue = plan_prompt(model, targets, 8, 2048, 1.5, 64)
    assert on_time.path is overdue.path is PREFILL
    room = 0.06 - model.predict(8)
    assert on_time.tokens == model.prompt_tokens_within(room, 0, PREFILL)
    assert overdue.tokens == model.prompt_tokens_within(2 * room, 0, PREFILL) > on_time.tokens


def test_a_prompts_chunks_grow_at_most_two_fold_a_step() -> None:
    model, targets = trained(), PacerTargets(itl=0.0085)  # room for 50 rows beside 8 decodes
    assert plan_prompt(model, targets, 8, 512, 0.0, 64).tokens == pytest.approx(50, abs=2)  # no cap asked for
    pacer = Pacer(targets, 64, model)
    chunks = []
    for _ in range(6):
        plan = pacer.plan(8, 512, 0.0, sum(chunks))
        chunks.append(plan.tokens)
        pacer.observe(8, plan.tokens, prompt_kilopositions(sum(chunks) - plan.tokens, plan.tokens),
                      cost(8, plan.tokens), plan.path)
    assert chunks[:4] == [MIN_PROMPT_TOKENS, 8, 16, 32]
    assert chunks[4] == chunks[5] == pytest.approx(50, abs=2)  # then the room, as before
    pacer.observe(8, 0, 0.0, cost(8, 0), ROWS)  # a decode-only step: the next prompt ramps up again
    assert pacer.plan(8, 512, 0.0, 0).tokens == MIN_PROMPT_TOKENS


def test_the_compiled_step_caps_the_rows_path() -> None:
    model = trained((*COSTS[:5], 1.0, *COSTS[6:]))  # a prefill path never worth its overhead
    plan = plan_prompt(model, PacerTargets(itl=0.02), 8, 512, 0.0, 64)
    assert plan == PromptPlan(56, ROWS)


def test_the_plan_always_stays_within_its_bounds() -> None:
    rng = random.Random(3)
    for seed in range(5):
        model = trained(steps=rng.randrange(0, 60), seed=seed)
        for _ in range(200):
            decode, step_budget, compiled_rows = rng.randrange(0, 64), rng.randrange(1, 600), rng.choice([0, 64])
            targets = PacerTargets(itl=rng.choice([None, rng.uniform(0.001, 0.05)]), ttft=rng.choice([None, 0.5]))
            plan = plan_prompt(model, targets, decode, step_budget, rng.uniform(0, 1), compiled_rows)
            assert min(MIN_PROMPT_TOKENS, step_budget) <= plan.tokens <= step_budget
            if plan.path is ROWS:
                assert compiled_rows and (decode + plan.tokens <= compiled_rows or not model.warm)
            else:
                assert decode == 0 or model.warm or not compiled_rows


def test_the_pacer_learns_from_every_step_on_its_path() -> None:
    pacer = Pacer(PacerTargets(), compiled_rows=64)
    pacer.observe(0, 300, 45.0, 0.5, PREFILL)  # prompt only: the prefill path
    pacer.observe(8, 100, 5.0, 0.5, PREFILL)
    pacer.observe(8, 16, prompt_kilopositions(0, 16), cost(8, 16), ROWS)
    assert pacer.model.num_with_prompt == 3
    before = pacer.model.coefficients.copy()
    pacer.observe(8, 0, 0.0, 0.03, ROWS)
    assert pacer.model.num_decode_only == 1 and (pacer.model.coefficients != before).any()


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
    pacer = Pacer(PacerTargets(itl=0.0085), 64, trained())  # room: 8.5 - 6 ms = 50 rows
    pacer.last_prompt_tokens = 32  # the step before carried 32: the growth cap (64) is past the room
    scheduler = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=512, pacer=pacer)
    streams = [running_request(kv, f"s{i}", 4, 4) for i in range(8)]
    for stream in streams:
        stream.token_ids.append(7)  # it has sampled: it decodes now
    scheduler.running.extend(streams)
    scheduler.add(Request("long", list(range(3, 1003)), SamplingParams(max_tokens=1)))
    batch = scheduler.schedule()
    assert batch.num_decode_tokens == 8
    assert batch.prompt_budget == pytest.approx(50, abs=2)
    assert batch.num_prompt_tokens == batch.prompt_budget and batch.prompt_path is ROWS


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
    paced.scheduler.pacer.model = fixed_model((0.004, 0.00025, 0.0, 0.0, 0.0, 0.0, 0.0002, 0.0))  # chunks of ~20
    fixed = LLMEngine(EngineConfig(model=tiny.config.model, num_kv_blocks=256, block_size=4,
                                   max_prefill_chunk=3), tiny.loaded)
    assert stream_then_prompts(paced) == stream_then_prompts(fixed)
    paced_prompts = {s["prompt_tokens"] for s in paced.timings.steps.rows() if s["decode_tokens"]}
    fixed_prompts = {s["prompt_tokens"] for s in fixed.timings.steps.rows() if s["decode_tokens"]}
    assert max(fixed_prompts) == 3  # the fixed chunk holds while streams decode
    assert max(paced_prompts) > 3
    assert {s["path"] for s in paced.timings.steps.rows() if s["prompt_tokens"]} == {"prefill"}  # eager: one path
    for engine in (paced, fixed):
        engine.check_integrity()
        assert engine.kv.num_free_blocks == len(engine.kv.blocks)
