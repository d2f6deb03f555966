"""The asyncio front: streams, aborts and n choices, with the engine loop in its thread."""

import asyncio

import pytest

from vivace import EngineConfig, FinishReason, LLM, SamplingParams
from vivace.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, block_size=4))
    yield engine
    engine.check_integrity()
    engine.shutdown()


async def collect(engine, prompt, params, request_id):
    texts, token_ids, finishes = {}, {}, {}
    async for out in engine.generate(prompt, params, request_id):
        for choice in out.outputs:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            token_ids.setdefault(choice.index, []).extend(choice.token_ids)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return texts, token_ids, finishes, out


async def test_streamed_deltas_add_up_to_the_offline_output(engine, tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = "Once upon a time"
    texts, token_ids, finishes, last = await collect(engine, prompt, params, "stream-1")
    expected = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4).generate(prompt, params)[0].outputs[0]
    assert texts[0] == expected.text and token_ids[0] == expected.token_ids
    assert finishes[0] == FinishReason.LENGTH and last.finished
    assert last.timings.first_token is not None and len(last.timings.token_times) == 20


async def test_concurrent_streams_and_n_choices(engine):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    results = await asyncio.gather(*(collect(engine, f"Story {i}:", params, f"multi-{i}") for i in range(6)))
    for _, token_ids, finishes, last in results:
        assert sorted(token_ids) == [0, 1] and all(len(t) == 12 for t in token_ids.values())
        assert finishes == {0: FinishReason.LENGTH, 1: FinishReason.LENGTH} and last.finished


async def test_abort_and_early_close_free_the_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = engine.generate("abort me", params, "to-abort")
    first = await anext(stream)
    assert first.outputs[0].token_ids
    engine.abort("to-abort")
    async for out in stream:
        last = out
    assert last.finished and last.outputs[0].finish_reason == FinishReason.ABORT

    closed = engine.generate("close me", params, "to-close")
    await anext(closed)
    await closed.aclose()
    stats = await settled(engine, lambda stats: stats.num_running == 0 and stats.num_waiting == 0)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    engine.check_integrity()


async def settled(engine, done):
    """The engine's stats once ``done(stats)`` holds, or after ~2 s (commands are applied by the
    engine thread within a step)."""
    for _ in range(200):
        stats = engine.stats()
        if done(stats):
            break
        await asyncio.sleep(0.01)
    return stats


async def test_generate_queues_the_request_before_its_stream_is_read(engine):
    """A streamed response queues its request before sending its headers: the engine takes it up
    at the call, and closing the stream unread still aborts it and frees its blocks."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = engine.generate("queued at the call", params, "queued")
    assert (await settled(engine, lambda stats: stats.num_running == 1)).num_running == 1
    await stream.aclose()
    stats = await settled(engine, lambda stats: stats.num_running == 0 and stats.num_waiting == 0)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert "queued" not in engine._streams
    engine.check_integrity()


async def test_a_prompt_too_long_is_a_value_error(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        async for _ in engine.generate([5] * 2000, SamplingParams(max_tokens=10), "too-long"):
            pass


def test_a_burst_of_commands_is_taken_in_a_few_per_step():
    """Adds and aborts are applied COMMANDS_PER_STEP at a time, in order, between steps: 20,000
    adds at once (one completions request's prompts) would hold every running stream ~1 s."""
    import queue
    from types import SimpleNamespace

    from vivace.engine.async_engine import COMMANDS_PER_STEP

    applied = []
    front = SimpleNamespace(_commands=queue.SimpleQueue(), _apply=applied.append)
    for i in range(COMMANDS_PER_STEP * 2 + 5):
        front._commands.put(("add", i))
    for drained in (COMMANDS_PER_STEP, 2 * COMMANDS_PER_STEP, 2 * COMMANDS_PER_STEP + 5):
        AsyncEngine._drain_commands(front, block=False)
        assert [c[1] for c in applied] == list(range(drained))


async def test_a_steps_tokens_reach_their_stream_before_the_next_step_starts(engine):
    """With ``delivery_wait`` (on where a step fills every core) the engine thread starts a step
    only once the event loop has handed the last step's tokens to their streams: between two
    tokens of a lone stream exactly one step starts; none is sent one step late with the next."""
    import time

    from vivace.engine.async_engine import steps_fill_the_cores

    assert not steps_fill_the_cores("cuda")
    saved, engine.delivery_wait = engine.delivery_wait, 60.0  # unbounded: the order is certain
    try:
        received = []
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        async for out in engine.generate("The lighthouse keeper", params, "delivery"):
            received.append(time.perf_counter())
    finally:
        engine.delivery_wait = saved
    assert len(received) == 24
    starts = [step["start"] for step in engine.timings.steps.rows(received[0])]
    between = [sum(a < s < b for s in starts) for a, b in zip(received, received[1:])]
    assert between == [1] * 23
