"""The pacer where every prompt chunk runs the eager step (``fill_eager``: the CUDA runner): with
GPU-like learned costs (a fixed cost per eager step far above a decode step, a prompt token nearly
free) a prompt beside decodes is done in a few steps, filled up to the step's fixed cost; with
dear tokens the fill stays bounded by them; with CPU-like costs and ``fill_eager`` off the plans are
issue 14's. Synthetic costs, no clocks."""

from __future__ import annotations

import types

import pytest

from vivace.config import EngineConfig
from vivace.engine.llm_engine import LLMEngine
from vivace.engine.pacer import (
    COLD_PROMPT_TOKENS, DEEP_MIN_PROMPT_TOKENS, FILL_FACTOR, MIN_PROMPT_TOKENS, WARM_STEPS, Pacer, PacerTargets,
    PromptPath, PromptPlan, StepCostModel, eager_fill, plan_prompt, prompt_kilopositions)
from tests.engine.test_pacer import COSTS, DEEP_COSTS, cost, fixed_model, trained

ROWS, PREFILL = PromptPath.ROWS, PromptPath.PREFILL
# As measured on an H200 (llama-3.1-8b, bfloat16): a decode step replays a graph in ~5.3 ms at 16
# rows; an eager step costs ~18 ms more (host launches), plus 0.008 ms a prompt token and 0.005 ms
# per thousand positions (eager prefill of 128 / 512 / 2,048 tokens: 19.2 / 22.9 / 45.2 ms). No
# rows path: the CUDA runner's graphs replay decodes alone.
GPU_COSTS = (0.005, 0.00002, 0.0, 0.0, 0.0, 0.018, 0.000008, 0.000005)
# The same GPU with prompt tokens 12 x dearer (a bigger model, say): 0.1 ms each.
DEAR_GPU_COSTS = (0.005, 0.00002, 0.0, 0.0, 0.0, 0.018, 0.0001, 0.000005)


def eager_cost(decode_tokens: int, prompt_tokens: int, costs: tuple[float, ...], start: int = 0) -> float:
    """What a step costs on a device whose prompt chunks always run eagerly."""
    return cost(decode_tokens, prompt_tokens, costs, start, PREFILL if prompt_tokens else ROWS)


def gpu_pacer(costs: tuple[float, ...] = GPU_COSTS) -> Pacer:
    """A cold pacer as the engine builds it over the CUDA runner, after the step of prompts alone
    that began serving (512 tokens, nothing decoding)."""
    pacer = Pacer(PacerTargets(), compiled_rows=0, fill_eager=True)
    pacer.observe(0, 512, prompt_kilopositions(0, 512), eager_cost(0, 512, costs), PREFILL)
    return pacer


def steps_per_prompt(pacer: Pacer, costs: tuple[float, ...], prompts: int, prompt_len: int = 512,
                     decode_tokens: int = 16, step_tokens: int = 512) -> list[list[int]]:
    """The chunks each of ``prompts`` prompts gets, one after another, beside ``decode_tokens``
    decodes (the pacer sees no decode-only step: on the overlapped engine those run queued ahead)."""
    chunks: list[list[int]] = []
    for _ in range(prompts):
        done, mine = 0, []
        while done < prompt_len:
            plan = pacer.plan(decode_tokens, step_tokens - decode_tokens, 0.0, done)
            assert plan.path is PREFILL
            tokens = min(plan.tokens, prompt_len - done)
            pacer.observe(decode_tokens, tokens, prompt_kilopositions(done, tokens),
                          eager_cost(decode_tokens, tokens, costs, done), PREFILL)
            done += tokens
            mine.append(tokens)
        chunks.append(mine)
    return chunks


def test_a_warm_gpu_model_fills_the_eager_step_up_to_its_fixed_cost() -> None:
    model = fixed_model(GPU_COSTS)
    fixed = eager_cost(16, 0, GPU_COSTS) + GPU_COSTS[5]  # 23.3 ms: the eager step with no prompt token
    # The room under the default target (one decode step, 5.3 ms) holds no eager step at all.
    assert model.prompt_tokens_within(model.predict(16), 0, PREFILL) == 0
    assert plan_prompt(model, PacerTargets(), 16, 496, 0.0) == PromptPlan(MIN_PROMPT_TOKENS, PREFILL)  # issue 14
    # Filled: all the step's budget (1,846 tokens would cost no more than the step's fixed cost) ...
    assert plan_prompt(model, PacerTargets(), 16, 496, 0.0, fill_eager=True) == PromptPlan(496, PREFILL)
    # ... or, with a budget past it, the most tokens whose cost is the fixed cost, to a token.
    plan = plan_prompt(model, PacerTargets(), 16, 8192, 0.0, fill_eager=True)
    assert plan.path is PREFILL and plan.tokens == pytest.approx(1846, abs=2)
    added = [eager_cost(16, tokens, GPU_COSTS) - fixed for tokens in (plan.tokens, plan.tokens + 1)]
    assert added[0] <= FILL_FACTOR * fixed + 1e-9 < added[1]
    # Deeper into a long prompt, tokens cost more: fewer of them.
    assert plan_prompt(model, PacerTargets(), 16, 8192, 0.0, prompt_start=20000, fill_eager=True).tokens < plan.tokens


def test_a_target_the_eager_step_can_meet_is_kept() -> None:
    model = fixed_model(GPU_COSTS)
    # 40 ms between tokens leaves 34.7 ms of room: an eager step with ~1,440 tokens fits; no more.
    plan = plan_prompt(model, PacerTargets(itl=0.040), 16, 8192, 0.0, fill_eager=True)
    assert plan.path is PREFILL and plan.tokens == model.prompt_tokens_within(0.040 - model.predict(16), 0, PREFILL)
    assert eager_cost(16, plan.tokens, GPU_COSTS) <= 0.040 + 1e-9


def test_a_prompt_beside_16_streams_is_done_in_a_few_steps_on_a_gpu() -> None:
    chunks = steps_per_prompt(gpu_pacer(), GPU_COSTS, prompts=6)
    # Cold, the fill doubles from the cold chunk a step while the costs are learned ...
    assert chunks[0][:2] == [2 * COLD_PROMPT_TOKENS, 4 * COLD_PROMPT_TOKENS]
    assert len(chunks[0]) <= 8
    # ... then each prompt takes the step's whole budget: 2 steps (496 + 16), where the cold chunk
    # took 32 (~0.75 s at 23 ms a step on the H200) and the floor would take 128.
    assert [len(c) for c in chunks[2:]] == [2] * 4
    assert all(c[0] == 496 for c in chunks[2:])


def test_without_the_fill_a_gpu_prompt_crawls() -> None:
    # The pacer the CUDA runner got before: its 64 graph rows taken for a rows path it lacks; cold
    # (no decode-only step is observed while prompts queue), 16 tokens a step.
    pacer = Pacer(PacerTargets(), compiled_rows=64)
    pacer.observe(0, 512, prompt_kilopositions(0, 512), eager_cost(0, 512, GPU_COSTS), PREFILL)
    plans = {pacer.plan(16, 496, 0.0, start) for start in range(0, 512, 16)}
    assert plans == {PromptPlan(COLD_PROMPT_TOKENS, ROWS)}  # run eagerly all the same: 32 steps


def test_dear_prompt_tokens_bound_the_fill() -> None:
    pacer = gpu_pacer(DEAR_GPU_COSTS)
    steps_per_prompt(pacer, DEAR_GPU_COSTS, prompts=3, step_tokens=2048)
    plan = pacer.plan(16, 2032, 0.0, 0)
    fixed = eager_cost(16, 0, DEAR_GPU_COSTS) + DEAR_GPU_COSTS[5]
    # At most ~233 tokens (23.3 ms at 0.1 ms), not 2,032 (226 ms): the step costs at most about twice
    # its fixed cost. (Every step beside 16 decodes, the fit splits the two costs within ~25%: 177.)
    ideal = FILL_FACTOR * fixed / DEAR_GPU_COSTS[6]
    assert 0.6 * ideal <= plan.tokens <= 1.05 * ideal
    assert eager_cost(16, plan.tokens, DEAR_GPU_COSTS) <= 2.05 * fixed


def test_the_cold_fill_ramps_then_follows_the_fit() -> None:
    model = StepCostModel()
    assert eager_fill(model, 16, 0) == COLD_PROMPT_TOKENS  # nothing seen yet
    pacer = gpu_pacer(DEAR_GPU_COSTS)
    assert eager_fill(pacer.model, 16, 0) == 2 * COLD_PROMPT_TOKENS
    steps_per_prompt(pacer, DEAR_GPU_COSTS, prompts=2, step_tokens=2048)
    assert pacer.model.num_with_prompt >= WARM_STEPS
    assert eager_fill(pacer.model, 16, 0) == pacer.model.eager_fill_tokens(16, 0)


def test_cpu_like_costs_plan_as_issue_14_unless_the_fill_is_asked_for() -> None:
    model, deep, tight = trained(), trained(DEEP_COSTS), PacerTargets(itl=0.001)
    # The CPU's pacer (fill_eager off): the floor, on the path where it costs less; the rows' room.
    assert plan_prompt(model, tight, 8, 512, 0.0, 64) == PromptPlan(MIN_PROMPT_TOKENS, ROWS)
    assert plan_prompt(deep, tight, 8, 512, 0.0, 64, 40000) == PromptPlan(DEEP_MIN_PROMPT_TOKENS, PREFILL)
    assert plan_prompt(StepCostModel(), PacerTargets(), 8, 512, 0.0, 64) == PromptPlan(COLD_PROMPT_TOKENS, ROWS)
    assert plan_prompt(StepCostModel(), PacerTargets(), 8, 512, 0.0) == PromptPlan(COLD_PROMPT_TOKENS, PREFILL)
    # The fill changes only a floor (or a cold chunk) that runs eagerly; rows are not filled.
    for costs_model, start in ((model, 0), (model, 3000), (deep, 0), (deep, 3000)):
        for itl in (None, 0.008, 0.035):
            plain = plan_prompt(costs_model, PacerTargets(itl=itl), 8, 512, 0.0, 64, start)
            assert plan_prompt(costs_model, PacerTargets(itl=itl), 8, 512, 0.0, 64, start, fill_eager=True) == plain
    filled = plan_prompt(deep, tight, 8, 512, 0.0, 64, 40000, fill_eager=True)
    assert filled.path is PREFILL and filled.tokens > DEEP_MIN_PROMPT_TOKENS
    assert plan_prompt(trained(COSTS), tight, 8, 512, 0.0, 64, fill_eager=True) == PromptPlan(MIN_PROMPT_TOKENS, ROWS)


def test_the_engine_fills_where_prompt_chunks_run_eagerly(tiny_model_dir) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4))
    cpu = engine.scheduler.pacer
    assert not cpu.fill_eager and cpu.compiled_rows == engine.runner.compiled_rows
    engine.runner = types.SimpleNamespace(eager_prompt_steps=True, compiled_rows=64)  # as the CUDA runner
    gpu = engine._new_pacer()
    assert gpu.fill_eager and gpu.compiled_rows == 0 and gpu.token_buckets == ()
    engine.runner.prompt_step_buckets = [16, 32, 64, 128, 256, 512]  # with prompt-step graphs
    assert engine._new_pacer().token_buckets == (16, 32, 64, 128, 256, 512)
    assert LLMEngine._new_pacer(types.SimpleNamespace(runner=engine.runner, config=EngineConfig(
        max_prefill_chunk=64))) is None  # a fixed chunk turns the pacer off there too


def test_the_cuda_runner_says_its_prompt_chunks_run_eagerly() -> None:
    pytest.importorskip("triton", reason="the CUDA backend needs triton")
    from vivace.gpu.runner import CudaRunner

    assert CudaRunner.eager_prompt_steps is True


# As the pacer learned them behind the served 8B shape on an H200 (its decode and prompt-step graphs,
# benchmarks/served_sim.py): 3 ms a step and 0.1 ms a decode row; the prefill path 4 ms more, and
# 0.025 ms a prompt token. Beside 11 decodes the default target (twice the 4.1 ms decode step) left
# room for ~5 prompt tokens: steps paying the path's whole fixed cost for them, 512-token prompts
# admitted ~100 ms apart, 64 streams at 1,170 tokens/s with a TTFT p50 of 5.8 s.
SERVED_GPU_COSTS = (0.003, 0.0001, 0.0, 0.0, 0.0, 0.004, 0.000025, 0.0)
BUCKETS = (16, 32, 64, 128, 256, 512)


def test_under_the_default_target_a_prefill_step_carries_at_least_the_fill() -> None:
    model = fixed_model(SERVED_GPU_COSTS)
    room = model.prompt_tokens_within(model.predict(11), 0, PREFILL)
    assert MIN_PROMPT_TOKENS <= room <= 8  # the room alone: a few tokens, each step paying ~8 ms for them
    plan = plan_prompt(model, PacerTargets(), 11, 501, 0.0, fill_eager=True)
    fill = model.eager_fill_tokens(11, 0)
    assert plan == PromptPlan(fill, PREFILL) and fill > 250  # the path's fixed cost is at most half the step
    # An explicit target is the user's: kept where the step can meet it, as before.
    explicit = PacerTargets(itl=2 * model.predict(11))
    assert plan_prompt(model, explicit, 11, 501, 0.0, fill_eager=True) == PromptPlan(room, PREFILL)
    # Without the fill (the CPU's pacer), the room's few tokens.
    assert plan_prompt(model, PacerTargets(), 11, 501, 0.0, compiled_rows=0) == PromptPlan(room, PREFILL)


def test_a_prefill_step_is_rounded_up_to_fill_its_graph_bucket() -> None:
    model = fixed_model(SERVED_GPU_COSTS)
    for decode in (1, 11, 40, 64, 100):
        plain = plan_prompt(model, PacerTargets(itl=0.012), decode, 512 - decode, 0.0, fill_eager=True)
        plan = plan_prompt(model, PacerTargets(itl=0.012), decode, 512 - decode, 0.0, fill_eager=True,
                           token_buckets=BUCKETS)
        assert plan.path is PREFILL and plan.tokens >= plain.tokens
        # the smallest bucket holding the step's tokens, all of it: its replay costs the same
        assert decode + plan.tokens == min(b for b in BUCKETS if b >= decode + plain.tokens)
    # Never past the step's budget; a step past the largest bucket (eager) is not rounded.
    assert plan_prompt(model, PacerTargets(itl=0.012), 40, 472, 0.0, fill_eager=True,
                       token_buckets=BUCKETS).tokens == 88  # 128 in all
    assert plan_prompt(model, PacerTargets(itl=0.012), 40, 60, 0.0, fill_eager=True,
                       token_buckets=BUCKETS).tokens == 60
    assert plan_prompt(model, PacerTargets(), 64, 2048, 0.0, fill_eager=True, token_buckets=BUCKETS) \
        == plan_prompt(model, PacerTargets(), 64, 2048, 0.0, fill_eager=True)  # the fill: past 512 tokens
    # With nothing decoding the whole budget goes to prompts, as before.
    assert plan_prompt(model, PacerTargets(), 0, 300, 0.0, fill_eager=True, token_buckets=BUCKETS).tokens == 300
