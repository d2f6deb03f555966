"""Automatic prefix caching seen from the API: a second chat turn reports the first turn's
prompt and answer as ``usage.prompt_tokens_details.cached_tokens``, and /metrics counts
prefix-cache queries and hits in tokens."""

from __future__ import annotations

import openai
import pytest

from .harness import RunningServer, metric_value

BLOCK_SIZE = 16


def chat_turns(server: RunningServer, model: str, questions: list[str], max_tokens: int) -> list:
    """Each question asked after the previous ones and their answers; the responses."""
    client = server.client()
    messages, responses = [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                  max_tokens=max_tokens)
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        responses.append(response)
    return responses


def test_second_turn_reuses_the_first_turns_prompt(server: RunningServer) -> None:
    """On a random model the answer's text need not re-tokenize to the generated tokens, so
    only the first turn's prompt is sure to be shared; the default-model test below checks
    the answer too, and tests/engine/test_scheduler.py checks generated tokens exactly."""
    queries = metric_value(server, "vivace:prefix_cache_queries_total")
    hits = metric_value(server, "vivace:prefix_cache_hits_total")
    first, second = chat_turns(server, "tiny", ["Tell me a story about a lighthouse keeper.",
                                                "Now make it shorter."], max_tokens=8)
    prompt = first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= prompt // BLOCK_SIZE * BLOCK_SIZE > 0
    assert second.model_extra["timings"]["cached_tokens"] == cached
    turn_tokens = first.usage.prompt_tokens + second.usage.prompt_tokens
    assert metric_value(server, "vivace:prefix_cache_queries_total") - queries == turn_tokens
    assert metric_value(server, "vivace:prefix_cache_hits_total") - hits == (
        first.usage.prompt_tokens_details.cached_tokens + cached)


@pytest.mark.slow
def test_second_turn_caches_the_first_turns_prompt_and_answer(default_server: RunningServer) -> None:
    first, second = chat_turns(default_server, "smol", ["What is the capital of France?",
                                                        "And what is the capital of Italy?"], 64)
    assert first.choices[0].finish_reason == "stop"
    # The answer's text, without the end-of-turn token the template writes back after it.
    answer = first.usage.completion_tokens - 1
    shared = first.usage.prompt_tokens + answer
    assert second.usage.prompt_tokens_details.cached_tokens >= shared // BLOCK_SIZE * BLOCK_SIZE


def test_cache_salt_keeps_each_tenants_prefix_to_itself(server: RunningServer) -> None:
    client = server.client()
    prompt = "Salted: " + " ".join(f"word{i}" for i in range(40))

    def cached(**extra) -> int:
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0  # unsalted requests don't see salted blocks either
    with pytest.raises(openai.BadRequestError) as bad:
        cached(cache_salt="")
    assert bad.value.body["param"] == "cache_salt"
