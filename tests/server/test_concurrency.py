"""16 concurrent streams: each completes with the right token count, and none waits for
another to finish before receiving its first token."""

from __future__ import annotations

import asyncio
import time

from .harness import RunningServer, metric_value

NUM_STREAMS = 16
MAX_TOKENS = 48


async def one_stream(server: RunningServer, i: int) -> tuple[float, float, int, int]:
    """(first token time, finish time, content chunks, completion tokens) of one stream."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    first, chunks, usage = None, 0, None
    async with client:
        stream = await client.completions.create(
            model="tiny", prompt=f"Stream number {i} says", max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
                chunks += 1
            usage = chunk.usage or usage
    return first, time.perf_counter(), chunks, usage.completion_tokens


async def all_streams(server: RunningServer) -> list[tuple[float, float, int, int]]:
    return await asyncio.gather(*(one_stream(server, i) for i in range(NUM_STREAMS)))


def test_sixteen_streams_interleave_and_complete(server: RunningServer) -> None:
    generated_before = metric_value(server, "vivace:generation_tokens_total")
    results = asyncio.run(all_streams(server))
    assert [tokens for *_, tokens in results] == [MAX_TOKENS] * NUM_STREAMS
    assert all(chunks > 1 for _, _, chunks, _ in results)
    last_first_token = max(first for first, *_ in results)
    first_finish = min(finish for _, finish, *_ in results)
    assert last_first_token < first_finish, "a stream got no token until another had finished"
    generated = metric_value(server, "vivace:generation_tokens_total") - generated_before
    assert generated == NUM_STREAMS * MAX_TOKENS
    assert metric_value(server, "vivace:request_success_total", finished_reason="length") >= 16
