"""Priorities on a real server: a premium-tier request (priority 0) that arrives behind 32
queued free-tier requests (priority 10) gets its first token before any of them."""

from __future__ import annotations

import asyncio
import time

import openai

from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings
from vivace.server.tiers import Tier

from .conftest import LONG_RUN
from .harness import RunningServer, assert_engine_idle, serving

NUM_QUEUED = 32
TIERS = {"k-free": Tier("free", priority=10), "k-premium": Tier("premium", priority=0)}


def client(server: RunningServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


async def first_chunk_time(api: openai.AsyncOpenAI, prompt: str) -> float:
    """When the first chunk of a two-token streamed completion arrived."""
    stream = await api.completions.create(model="tiny", prompt=prompt, max_tokens=2, stream=True,
                                          extra_body={"ignore_eos": True})
    first = None
    async for _ in stream:
        first = first or time.perf_counter()
    assert first is not None
    return first


async def wait_for_waiting(engine: AsyncEngine, count: int) -> None:
    deadline = time.monotonic() + 60
    while engine.stats().num_waiting < count:
        assert time.monotonic() < deadline, f"{count} requests never queued"
        await asyncio.sleep(0.01)


async def race(server: RunningServer, engine: AsyncEngine) -> tuple[float, list[float]]:
    free, premium = client(server, "k-free"), client(server, "k-premium")
    async with free, premium:
        blocker = await free.completions.create(model="tiny", prompt="Hold the only slot",
                                                max_tokens=LONG_RUN, stream=True,
                                                extra_body={"ignore_eos": True})
        await anext(aiter(blocker))  # it is running now
        queued = [asyncio.ensure_future(first_chunk_time(free, f"Free request {i}"))
                  for i in range(NUM_QUEUED)]
        await wait_for_waiting(engine, NUM_QUEUED)
        urgent = asyncio.ensure_future(first_chunk_time(premium, "Premium request"))
        await wait_for_waiting(engine, NUM_QUEUED + 1)
        await blocker.close()  # frees the slot: the scheduler picks by priority, then arrival
        return await urgent, await asyncio.gather(*queued)


def test_priority_zero_overtakes_32_queued_priority_ten(single_slot_engine: AsyncEngine) -> None:
    settings = ServerSettings(api_keys=tuple(TIERS), key_tiers=TIERS, served_model_name="tiny")
    with serving(single_slot_engine, settings) as server:
        urgent, queued = asyncio.run(race(server, single_slot_engine))
    assert urgent < min(queued), "a priority-10 request got a token before the priority-0 one"
    assert_engine_idle(single_slot_engine)
