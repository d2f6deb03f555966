"""Load generation: arrival process, bounds, concurrency, warm-up, multi-turn history."""

import math
import statistics
import time

import httpx

from vivace.bench.client import Endpoint
from vivace.bench.load import LoadPlan, arrival_gaps, run_load, warm_up
from vivace.bench.workloads import Conversation


def one_turn(count: int, output_len: int = 2) -> list[Conversation]:
    return [Conversation((f"prompt {index}",), output_len) for index in range(count)]


def test_poisson_gaps_are_seeded_and_average_one_over_the_rate() -> None:
    plan = LoadPlan(request_rate=20.0, seed=7)
    first = [gap for gap, _ in zip(arrival_gaps(plan), range(4000))]
    again = [gap for gap, _ in zip(arrival_gaps(plan), range(4000))]
    assert first == again
    assert abs(statistics.mean(first) - 0.05) < 0.005
    bursty = [gap for gap, _ in zip(arrival_gaps(LoadPlan(request_rate=20.0, burstiness=0.25)), range(4000))]
    assert abs(statistics.mean(bursty) - 0.05) < 0.01
    assert statistics.stdev(bursty) > 1.5 * statistics.stdev(first)  # cv = 1/sqrt(shape)


def test_infinite_rate_sends_at_once() -> None:
    assert [gap for gap, _ in zip(arrival_gaps(LoadPlan(request_rate=math.inf)), range(3))] == [0.0, 0.0, 0.0]


async def test_concurrency_caps_requests_in_flight(scripted) -> None:
    server = await scripted(ttft_s=0.05, itl_s=0.01, tokens=3)  # long enough for 3 to overlap
    endpoint = Endpoint(server.url, "completions", "m")
    async with httpx.AsyncClient() as client:
        run = await run_load(client, endpoint, one_turn(9), LoadPlan(concurrency=3, max_requests=9))
    assert len(run.results) == 9 and all(result.success for result in run.results)
    assert server.max_in_flight == 3
    assert run.results == sorted(run.results, key=lambda result: result.sent_at)


async def test_count_bound_stops_early(scripted) -> None:
    server = await scripted(ttft_s=0.001, itl_s=0.001, tokens=2)
    async with httpx.AsyncClient() as client:
        run = await run_load(client, Endpoint(server.url, "completions", "m"), one_turn(10),
                             LoadPlan(concurrency=2, max_requests=4))
    assert len(run.results) == 4 and len(server.served) == 4


async def test_duration_bound_stops_starting_requests(scripted) -> None:
    server = await scripted(ttft_s=0.05, itl_s=0.01, tokens=2)
    started = time.perf_counter()
    async with httpx.AsyncClient() as client:
        run = await run_load(client, Endpoint(server.url, "completions", "m"), one_turn(1000),
                             LoadPlan(concurrency=1, max_requests=1000, max_duration_s=0.2))
    assert 1 <= len(run.results) < 10
    assert time.perf_counter() - started < 2.0


async def test_multi_turn_chat_carries_the_replies(scripted) -> None:
    server = await scripted(ttft_s=0.001, itl_s=0.001, tokens=2)
    conversation = Conversation(("first", "second", "third"), 2)
    async with httpx.AsyncClient() as client:
        run = await run_load(client, Endpoint(server.url, "chat", "m"), [conversation], LoadPlan(max_requests=3))
    assert len(run.results) == 3
    last_messages = server.served[-1].body["messages"]
    assert [message["role"] for message in last_messages] == ["user", "assistant"] * 2 + ["user"]
    assert last_messages[1]["content"] == " t0 t1" and last_messages[-1]["content"] == "third"


async def test_multi_turn_completions_concatenate_history(scripted) -> None:
    server = await scripted(ttft_s=0.001, itl_s=0.001, tokens=1)
    conversation = Conversation(("A.", "B."), 1, expected_prompt_tokens=1)
    async with httpx.AsyncClient() as client:
        run = await run_load(client, Endpoint(server.url, "completions", "m"), [conversation], LoadPlan())
    assert server.served[1].body["prompt"] == "A. t0B."
    assert [result.expected_prompt_tokens for result in run.results] == [1, None]


async def test_warm_up_sends_first_turns_only(scripted) -> None:
    server = await scripted(ttft_s=0.001, itl_s=0.001, tokens=1)
    conversations = [Conversation(("a", "b"), 1), Conversation(("c", "d"), 1)]
    async with httpx.AsyncClient() as client:
        results = await warm_up(client, Endpoint(server.url, "completions", "m"), conversations, concurrency=2)
    assert len(results) == 2 and sorted(s.body["prompt"] for s in server.served) == ["a", "c"]
