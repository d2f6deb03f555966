"""Prompt logprobs through the official openai client, as lm-eval-harness's ``local-completions``
scores log-likelihoods: ``echo`` with ``logprobs`` (and ``max_tokens`` 1 or 0) returns the prompt's
tokens' logprobs before the generated ones, whole or streamed; vLLM's ``prompt_logprobs`` field."""

from __future__ import annotations

import pytest

from .harness import RunningServer

CONTEXT = "The capital of France is"
TEXT = CONTEXT + " Paris, and the capital of Italy is Rome."
COMPLETIONS = "/v1/completions"


def scoring(server: RunningServer, **changes: object):
    """lm-eval's request: the whole text echoed with its logprobs, one greedy token after it."""
    args = dict(model="tiny", prompt=TEXT, echo=True, logprobs=1, max_tokens=1, temperature=0)
    return server.client().completions.create(**{**args, **changes})


def test_echo_with_logprobs_reads_as_lm_eval_reads_it(server: RunningServer) -> None:
    ids = server.engine.tokenizer.encode(TEXT)
    reply = scoring(server, extra_body={"prompt_logprobs": 1})
    choice = reply.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(TEXT) and reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:len(ids)]) == TEXT
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert logprob <= 0 and 1 <= len(top) <= 2 and top[token] == logprob
    # lm-eval: the continuation's log-likelihood and whether it is greedy, from its slice.
    ctxlen = len(server.engine.tokenizer.encode(CONTEXT))
    continuation = lp.token_logprobs[ctxlen:-1]
    assert len(continuation) == len(ids) - ctxlen and all(isinstance(x, float) for x in continuation)
    is_greedy = all(x == max(top.values()) for x, top in zip(continuation, lp.top_logprobs[ctxlen:-1]))
    assert isinstance(is_greedy, bool)
    # The same numbers as vLLM's prompt_logprobs of the choice (keyed by token id).
    scored = choice.model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for token_id, logprob, entry in zip(ids[1:], lp.token_logprobs[1:], scored[1:]):
        mine = entry[str(token_id)]
        assert mine["logprob"] == logprob and mine["rank"] >= 1 and mine["decoded_token"]
        assert len(entry) <= 2 and min(e["rank"] for e in entry.values()) == 1


def test_echo_logprobs_are_the_same_streamed(server: RunningServer) -> None:
    ids = server.engine.tokenizer.encode(TEXT)
    whole = scoring(server, max_tokens=3, extra_body={"ignore_eos": True}).choices[0]
    chunks = [c for c in scoring(server, max_tokens=3, stream=True, extra_body={"ignore_eos": True}) if c.choices]
    echo = chunks[0].choices[0]
    assert echo.text == TEXT and len(echo.logprobs.tokens) == len(ids) and echo.logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(whole.logprobs.token_logprobs)
    assert all(abs(a - b) < 1e-5 for a, b in zip(streamed[1:], whole.logprobs.token_logprobs[1:]))
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and offsets[len(ids)] == len(TEXT)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_zero_returns_the_prompt_alone(server: RunningServer, stream: bool) -> None:
    ids = server.engine.tokenizer.encode(TEXT)
    reply = scoring(server, max_tokens=0, stream=stream,
                    **({"stream_options": {"include_usage": True}} if stream else {}))
    events = list(reply) if stream else [reply]
    choices = [c.choices[0] for c in events if c.choices]
    usage = events[-1].usage
    assert "".join(c.text for c in choices) == TEXT and choices[-1].finish_reason == "length"
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
    assert "".join(tokens) == TEXT and len(tokens) == len(ids)
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == 0
    if not stream:
        plain = server.client().completions.create(model="tiny", prompt=TEXT, echo=True, max_tokens=0)
        assert plain.choices[0].text == TEXT and plain.choices[0].logprobs is None


def test_n_choices_each_echo_their_prompt_logprobs(server: RunningServer) -> None:
    reply = scoring(server, n=2, max_tokens=2, temperature=1.0, seed=4)
    first, second = (c.logprobs for c in reply.choices)
    ids = server.engine.tokenizer.encode(TEXT)
    assert first.tokens[:len(ids)] == second.tokens[:len(ids)] and first.token_logprobs[0] is None
    assert all(abs(a - b) < 1e-5 for a, b in zip(first.token_logprobs[1:len(ids)], second.token_logprobs[1:len(ids)]))


def test_chat_has_vllm_prompt_logprobs(server: RunningServer) -> None:
    reply = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    scored = reply.model_extra["prompt_logprobs"]
    assert len(scored) == reply.usage.prompt_tokens and scored[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["logprob"] <= 0 for entry in scored[1:])
    assert "prompt_logprobs" not in server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1).model_extra


@pytest.mark.parametrize("body,param", [
    ({"prompt": TEXT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": TEXT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": TEXT, "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_what_is_refused(server: RunningServer, body: dict, param: str) -> None:
    with server.http() as http:
        response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
