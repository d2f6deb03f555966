"""Chat completions through the official openai client: whole and streamed, n, stop, seed,
logprobs, usage, finish reasons, timings."""

from __future__ import annotations

import openai
import pytest

from .harness import RunningServer

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def test_whole_answer_has_usage_timings_and_true_finish_reason(server: RunningServer) -> None:
    reply = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "tiny"
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content
    assert reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    timings = reply.model_extra["timings"]
    assert timings["completion_tokens"] == 8 and timings["ttft_ms"] > 0
    assert {"queue_ms", "prefill_ms", "decode_ms", "cached_tokens"} <= timings.keys()


def test_stream_matches_whole_answer_and_ends_with_usage(server: RunningServer) -> None:
    client = server.client()
    common = dict(model="tiny", messages=MESSAGES, max_completion_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**common)
    chunks = list(client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # One id and one timestamp (the request's) in every chunk, as OpenAI documents.
    assert {(c.id, c.created) for c in chunks} == {(chunks[0].id, chunks[0].created)}


def test_repeated_prompt_reports_cached_tokens(server: RunningServer) -> None:
    messages = [{"role": "user", "content": "word " * 60}]
    client = server.client()
    for _ in range(2):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 16


def test_n_choices_each_complete(server: RunningServer) -> None:
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, max_tokens=5,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 10
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, n=2,
                                                max_tokens=5, stream=True,
                                                extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(texts.values())


def test_stop_string_ends_the_answer_before_it(server: RunningServer) -> None:
    client = server.client()
    common = dict(model="tiny", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    text = client.chat.completions.create(max_tokens=12, **common).choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    stopped = client.chat.completions.create(max_tokens=12, stop=[stop], **common).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == text[:text.index(stop)]
    # vLLM's stop_reason names the stop string, in the whole answer and in the stream's last chunk
    assert stopped.model_extra["stop_reason"] == stop
    chunks = [c.choices[0] for c in client.chat.completions.create(max_tokens=12, stop=[stop], stream=True, **common)
              if c.choices]
    assert [c.model_extra["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [stop]


@pytest.mark.parametrize("stream", [False, True])
def test_seed_makes_sampling_reproducible(server: RunningServer, stream: bool) -> None:
    client = server.client()

    def sample(seed: int) -> str:
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                               temperature=1.0, seed=seed, stream=stream)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        return reply.choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs_have_top_alternatives(server: RunningServer) -> None:
    reply = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3,
        temperature=0, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


def test_logprob_bytes_of_part_of_a_character_are_that_part(server: RunningServer) -> None:
    """A token holding an emoji's first bytes decodes to U+FFFD; its ``bytes`` are still the emoji's
    first bytes (OpenAI's ``bytes`` exist so that a client can join them), not U+FFFD's."""
    emoji = "\N{PARTY POPPER}".encode()
    with server.http() as http:
        first = http.post("/tokenize", json={"prompt": "\N{PARTY POPPER}", "add_special_tokens": False}).json()["tokens"][0]
    reply = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=1,
        logit_bias={str(first): 100}, extra_body={"ignore_eos": True})
    for entry in reply.choices[0].logprobs.content:
        assert entry.token == "\ufffd" and 0 < len(entry.bytes) < len(emoji)
        assert bytes(entry.bytes) == emoji[:len(entry.bytes)] and entry.top_logprobs[0].bytes == entry.bytes


def test_models_lists_the_served_name(server: RunningServer) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_bookkeeping_fields_clients_send_are_accepted(server: RunningServer) -> None:
    reply = server.client().chat.completions.create(
        model="tiny", max_tokens=4, user="u-1", store=False, metadata={"trace": "abc"},
        service_tier="auto", messages=[{"role": "user", "content": "Hi", "name": "alice"}])
    assert reply.choices[0].message.content is not None


def test_openai_hints_clients_send_are_accepted(server: RunningServer) -> None:
    """What clients written for OpenAI's newer models send (the openai-agents SDK passes its model
    settings through): hints that change nothing here, answered like the same request without them."""
    common = dict(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = server.client().chat.completions.create(**common)
    hinted = server.client().chat.completions.create(**common, verbosity="low", modalities=["text"],
                                                     prompt_cache_retention="24h")
    assert hinted.choices[0].message.content == plain.choices[0].message.content


def test_audio_output_is_refused(server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                modalities=["text", "audio"])
    assert error.value.body["param"].startswith("modalities")


def test_cache_control_hints_are_accepted_and_change_nothing(server: RunningServer) -> None:
    """Anthropic's prompt-caching breakpoints, as OpenRouter and LiteLLM pass them on in chat requests
    (on text parts, messages and tools), are hints: the rendered prompt and the answer are the ones
    without them."""
    hint = {"type": "ephemeral"}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    plain = {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}],
             "tools": [tool]}
    hinted = {"messages": [{"role": "system", "content": "Be brief.", "cache_control": hint},
                           {"role": "user", "content": [{"type": "text", "text": "Tell me a story.",
                                                         "cache_control": {**hint, "ttl": "1h"}}]}],
              "tools": [{**tool, "cache_control": hint}]}
    with server.http() as http:
        tokens = [http.post("/tokenize", json=body).json()["tokens"] for body in (plain, hinted)]
        answers = [http.post("/v1/chat/completions", json={**body, "model": "tiny", "max_tokens": 4, "temperature": 0})
                   for body in (plain, hinted)]
    assert tokens[0] == tokens[1] and "cache_control" not in server.engine.tokenizer.decode(tokens[1])
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[0].json()["choices"] == answers[1].json()["choices"]
