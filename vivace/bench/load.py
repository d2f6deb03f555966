"""Drive conversations against an endpoint: fixed concurrency or a Poisson/gamma request
rate, with warm-up, bounded by a request count and a wall-clock duration.

A conversation holds one concurrency slot for all its turns; its turns go out one after
the other, each carrying the earlier turns and the replies the server actually gave.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from vivace.bench.client import Endpoint, RequestResult, stream_request
from vivace.bench.workloads import Conversation


@dataclass(frozen=True)
class LoadPlan:
    """How requests are offered. `concurrency` caps conversations in flight (None: no
    cap); `request_rate` is conversation starts per second (inf: all at once) with
    gamma-distributed gaps of shape `burstiness` (1 = Poisson, < 1 burstier); no request
    is started after `max_requests` have been, or after `max_duration_s`."""

    concurrency: int | None = 1
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_requests: int = 100
    max_duration_s: float = 600.0
    seed: int = 0


@dataclass
class LoadRun:
    """Measured results in start order, and the duration of the measured phase."""

    results: list[RequestResult]
    duration_s: float


class _Budget:
    """Hands out permission to start a request until the count or the time runs out."""

    def __init__(self, max_requests: int, deadline: float) -> None:
        self.left = max_requests
        self.deadline = deadline

    def take(self) -> bool:
        if self.left <= 0 or time.perf_counter() >= self.deadline:
            return False
        self.left -= 1
        return True


def arrival_gaps(plan: LoadPlan) -> Iterator[float]:
    """Seconds to wait before each conversation start: 0 for an infinite rate, else
    gamma(shape=burstiness, scale=1/(rate*burstiness)) draws, seeded by the plan."""
    rng = random.Random(plan.seed)
    while True:
        if math.isinf(plan.request_rate):
            yield 0.0
        else:
            yield rng.gammavariate(plan.burstiness, 1 / (plan.request_rate * plan.burstiness))


async def run_load(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    conversations: list[Conversation],
    plan: LoadPlan,
    on_result: Callable[[RequestResult], None] = lambda result: None,
) -> LoadRun:
    """Offer `conversations` as the plan says and return every request started. Each
    request is bounded by the client's timeout, so the run ends at most one request
    timeout (per remaining turn) after `max_duration_s`."""
    origin = time.perf_counter()
    budget = _Budget(plan.max_requests, origin + plan.max_duration_s)
    slots = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
    results: list[RequestResult] = []

    async def converse(conversation: Conversation) -> None:
        if slots is None:
            await run_turns(client, endpoint, conversation, origin, budget, results, on_result)
            return
        async with slots:
            await run_turns(client, endpoint, conversation, origin, budget, results, on_result)

    tasks = []
    for conversation, gap in zip(conversations, arrival_gaps(plan)):
        if budget.left <= 0 or time.perf_counter() >= budget.deadline:
            break
        tasks.append(asyncio.create_task(converse(conversation)))
        await asyncio.sleep(gap)
    await asyncio.gather(*tasks)
    results.sort(key=lambda result: result.sent_at)
    return LoadRun(results, time.perf_counter() - origin)


async def run_turns(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    conversation: Conversation,
    origin: float,
    budget: _Budget,
    results: list[RequestResult],
    on_result: Callable[[RequestResult], None],
) -> None:
    """Send a conversation's turns in order while the budget allows; stop at the first
    failed turn, since the next one would lack its history."""
    history: list[dict[str, str]] = []
    for index, turn in enumerate(conversation.turns):
        if not budget.take():
            return
        history.append({"role": "user", "content": turn})
        prompt: str | list[dict[str, str]] = (
            list(history) if endpoint.api == "chat" else "".join(message["content"] for message in history)
        )
        result = await stream_request(client, endpoint, prompt, conversation.output_len, origin)
        if index == 0 and endpoint.api == "completions":
            result.expected_prompt_tokens = conversation.expected_prompt_tokens
        results.append(result)
        on_result(result)
        if not result.success:
            return
        history.append({"role": "assistant", "content": result.text})


async def warm_up(client: httpx.AsyncClient, endpoint: Endpoint, conversations: list[Conversation],
                  concurrency: int | None) -> list[RequestResult]:
    """Send the first turn of each warm-up conversation, `concurrency` at a time; the
    results are returned for error checks only and count in no statistic."""
    plan = LoadPlan(concurrency=concurrency, max_requests=len(conversations))
    single_turns = [Conversation(c.turns[:1], c.output_len, c.expected_prompt_tokens) for c in conversations]
    return (await run_load(client, endpoint, single_turns, plan)).results
