"""Deadlines: a request that waits too long to be scheduled, or runs too long, ends with its
error and leaves every KV block free."""

from __future__ import annotations

import asyncio

import pytest

from vivace import EngineConfig, SamplingParams
from vivace.engine.async_engine import AsyncEngine
from vivace.engine.deadlines import DeadlineQueue, Deadlines, QueueTimeoutError, RequestTimeoutError

LONG = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, block_size=16,
                                      max_num_seqs=1))
    yield engine
    engine.shutdown()


async def assert_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_a_request_queued_past_its_delay_ends_and_the_running_one_goes_on(engine) -> None:
    running = engine.generate("occupy the only slot", LONG, "running")
    await anext(running)
    queued = engine.generate("wait behind it", LONG, "queued", deadlines=Deadlines(max_queue_delay=0.05))
    with pytest.raises(QueueTimeoutError):
        await anext(queued)
    assert (await anext(running)).outputs[0].token_ids, "the running request was disturbed"
    await running.aclose()
    await assert_idle(engine)


async def test_a_request_past_its_timeout_ends_with_its_blocks_freed(engine) -> None:
    stream = engine.generate("run for too long", LONG, "slow", deadlines=Deadlines(timeout=0.2))
    tokens = 0
    with pytest.raises(RequestTimeoutError):
        async for out in stream:
            tokens += len(out.outputs[0].token_ids)
    assert tokens < LONG.max_tokens
    await assert_idle(engine)


def test_deadline_queue_pops_in_time_order() -> None:
    queue = DeadlineQueue()
    queue.add("a", 10.0, Deadlines(max_queue_delay=1.0, timeout=5.0))
    queue.add("b", 10.5, Deadlines(timeout=0.25))
    assert queue.pop_expired(10.9) == [("b", False)]
    assert queue.pop_expired(14.0) == [("a", True)]
    assert queue.pop_expired(15.0) == [("a", False)]
    with pytest.raises(ValueError):
        Deadlines(timeout=0)
