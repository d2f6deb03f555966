"""Text completions through the official openai client: prompt shapes, echo, logprobs, n,
streaming with usage, finish reasons."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vivace.config import EngineConfig
from vivace.server import ServerSettings

from .harness import RunningServer, serving_own_engine

NO_EOS = {"ignore_eos": True}


def test_whole_and_streamed_text_agree(server: RunningServer) -> None:
    client = server.client()
    common = dict(model="tiny", prompt="Once upon a time", max_tokens=9, temperature=0,
                  extra_body=NO_EOS)
    whole = client.completions.create(**common)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 9
    assert whole.model_extra["timings"]["completion_tokens"] == 9
    chunks = list(client.completions.create(**common, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].choices == []
    finish = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finish.choices[0].finish_reason == "length"
    assert finish.model_extra["timings"]["completion_tokens"] == 9


def test_default_max_tokens_is_sixteen(server: RunningServer) -> None:
    reply = server.client().completions.create(model="tiny", prompt="Hi", extra_body=NO_EOS)
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_prompt_shapes_give_one_choice_per_prompt_and_n(server: RunningServer) -> None:
    client = server.client()
    ids = server.engine.tokenizer.encode("Once upon a time")
    for prompt in (["Once upon a time", "Long ago"], [ids, ids]):
        reply = client.completions.create(model="tiny", prompt=prompt, n=2, max_tokens=3,
                                          extra_body=NO_EOS)
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        assert reply.usage.completion_tokens == 12
    single = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0)
    by_text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3,
                                        temperature=0)
    assert single.choices[0].text == by_text.choices[0].text


def test_streamed_multi_prompt_covers_every_choice(server: RunningServer) -> None:
    stream = server.client().completions.create(
        model="tiny", prompt=["a", "b", "c"], max_tokens=4, stream=True, extra_body=NO_EOS)
    finished = sorted(c.index for chunk in stream for c in chunk.choices if c.finish_reason)
    assert finished == [0, 1, 2]


def test_echo_prepends_the_prompt(server: RunningServer) -> None:
    client = server.client()
    reply = client.completions.create(model="tiny", prompt="Echo me", echo=True, max_tokens=3,
                                      temperature=0)
    plain = client.completions.create(model="tiny", prompt="Echo me", max_tokens=3, temperature=0)
    assert reply.choices[0].text == "Echo me" + plain.choices[0].text
    streamed = client.completions.create(model="tiny", prompt="Echo me", echo=True, max_tokens=3,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text


def test_logprobs_per_token(server: RunningServer) -> None:
    reply = server.client().completions.create(model="tiny", prompt="Count", max_tokens=5,
                                               logprobs=2, extra_body=NO_EOS)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)  # the 2 most likely and the chosen one
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_min_tokens_and_extras_are_accepted(server: RunningServer) -> None:
    reply = server.client().completions.create(
        model="tiny", prompt="x", max_tokens=6,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"min_tokens": 6, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
                    "priority": 1})
    assert reply.usage.completion_tokens == 6


def test_stop_reason_names_the_stop_token_id(server: RunningServer) -> None:
    """vLLM's ``stop_reason``: the stop token id that ended a choice, null when the length did."""
    client = server.client()
    common = dict(model="tiny", prompt="hi", max_tokens=4, logit_bias={"30": 100})
    stopped = client.completions.create(**common, extra_body={"stop_token_ids": [30]}).choices[0]
    assert (stopped.finish_reason, stopped.model_extra["stop_reason"]) == ("stop", 30)
    cut = client.completions.create(**common, stream=True)
    assert [(c.choices[0].finish_reason, c.choices[0].model_extra["stop_reason"]) for c in cut][-1] == ("length", None)


def test_echoed_offsets_stay_in_the_text_when_tokens_split_characters(server: RunningServer) -> None:
    """Each emoji here is three tokens whose texts are U+FFFD: their offsets are where the emoji
    starts, not the U+FFFD counted three times, so the answer's offsets follow the prompt's."""
    prompt = "\N{PARTY POPPER}\N{PARTY POPPER} ok"
    choice = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True, logprobs=0,
                                                extra_body=NO_EOS).choices[0]
    offsets = choice.logprobs.text_offset
    assert offsets[:6] == [0, 0, 0, 1, 1, 1] and offsets == sorted(offsets)
    assert offsets[-2] == len(prompt) and choice.text.startswith(prompt)


def test_a_batch_of_prompts_lets_the_event_loop_turn_between_them(server: RunningServer, monkeypatch) -> None:
    """Each prompt of a batch is prepared in its own turn of the event loop, so other streams'
    events go out between them (20,000 prompts held the loop ~2 s in one go)."""
    import asyncio

    from vivace.server import completions

    turns, seen = [0], []

    def tick() -> None:
        turns[0] += 1
        if len(seen) < 40:
            asyncio.get_running_loop().call_soon(tick)

    def counted(tokenizer, prompt):
        if not seen:
            asyncio.get_running_loop().call_soon(tick)
        seen.append(turns[0])
        return prepare(tokenizer, prompt)
    prepare = completions.completion_prompt_ids
    monkeypatch.setattr(completions, "completion_prompt_ids", counted)
    reply = server.client().completions.create(model="tiny", prompt=["Hi"] * 40, max_tokens=1)
    assert len(reply.choices) == 40
    assert len(set(seen)) == 40  # the loop turned before each prompt


@pytest.fixture(scope="module")
def bos_server(make_tiny_llama) -> Iterator[RunningServer]:
    """The tiny model with a tokenizer that puts its BOS before every text prompt, as Llama 3's and
    Gemma's do (the default model's adds none)."""
    import transformers
    from tokenizers import processors

    model = make_tiny_llama()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    tokenizer.save_pretrained(model)
    with serving_own_engine(EngineConfig(model=str(model), max_model_len=128, num_kv_blocks=32),
                            ServerSettings(served_model_name="tiny")) as running:
        yield running


@pytest.mark.parametrize("stream", [False, True])
def test_echoed_offsets_skip_the_bos_the_tokenizer_added(bos_server: RunningServer, stream: bool) -> None:
    """The echoed text is the prompt as sent, without the BOS the tokenizer put before it: the BOS
    token is listed at offset 0 and takes no characters, so the offsets index the text and grow."""
    prompt = "Once upon a time"
    tokenizer = bos_server.engine.tokenizer
    assert tokenizer.encode(prompt)[0] == tokenizer.bos_token_id
    reply = bos_server.client().completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=1,
                                                   stream=stream, extra_body=NO_EOS)
    choices = [c.choices[0] for c in reply if c.choices] if stream else reply.choices
    text = "".join(c.text for c in choices)
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in choices if c.logprobs for o in c.logprobs.text_offset]
    assert text.startswith(prompt) and tokens[0] == tokenizer.bos_token and len(tokens) == len(offsets)
    assert offsets == sorted(offsets) and offsets[:2] == [0, 0] and offsets[-3] == len(prompt)
    assert all(text.startswith(token, offset) for token, offset in zip(tokens[1:], offsets[1:]))
