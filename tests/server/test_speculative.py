"""A server with n-gram speculation: the per-request opt-out, one token per streamed delta,
and the speculative-decoding metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings

from .conftest import MAX_MODEL_LEN
from .harness import RunningServer, assert_engine_idle, metric_value, serving

PROMPT = [101, 2050, 777, 3141, 59, 26535] * 5  # a phrase repeated: n-gram proposals land
GREEDY = dict(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0)
COUNTERS = ["vivace:spec_decode_num_drafts_total", "vivace:spec_decode_num_draft_tokens_total",
            "vivace:spec_decode_num_accepted_tokens_total"]


@pytest.fixture(scope="module")
def spec_engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN,
                                      num_kv_blocks=128, max_num_seqs=8, speculative="ngram"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def spec_server(spec_engine: AsyncEngine) -> Iterator[RunningServer]:
    with serving(spec_engine, ServerSettings(served_model_name="tiny")) as running:
        yield running


@pytest.fixture(autouse=True)
def _spec_engine_idle(spec_engine: AsyncEngine) -> Iterator[None]:
    yield
    assert_engine_idle(spec_engine)


def counters(server: RunningServer) -> list[float]:
    return [metric_value(server, name) for name in COUNTERS]


def test_opting_out_gives_the_same_text_and_moves_no_counter(spec_server: RunningServer) -> None:
    client = spec_server.client()
    before = counters(spec_server)
    plain = client.completions.create(**GREEDY, extra_body={"ignore_eos": True, "speculative": False})
    assert counters(spec_server) == before
    fast = client.completions.create(**GREEDY, extra_body={"ignore_eos": True})
    drafts, proposed, accepted = (b - a for a, b in zip(before, counters(spec_server)))
    assert fast.choices[0].text == plain.choices[0].text and fast.usage.completion_tokens == 32
    assert drafts > 0 and proposed >= accepted > 0
    assert 0 < metric_value(spec_server, "vivace:spec_decode_acceptance_rate") <= 1
    assert metric_value(spec_server, "vivace:spec_decode_mean_accepted_length") > 1


def test_chat_accepts_the_opt_out_and_rejects_a_non_boolean(spec_server: RunningServer) -> None:
    client = spec_server.client()
    messages = [{"role": "user", "content": "one two three one two three one two"}]
    before = counters(spec_server)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"speculative": False})
    assert reply.choices[0].finish_reason in ("stop", "length") and counters(spec_server) == before
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                       extra_body={"speculative": "sometimes"})
    assert "speculative" in str(error.value)


def test_accepted_tokens_stream_as_separate_deltas(spec_server: RunningServer) -> None:
    before = counters(spec_server)
    chunks = list(spec_server.client().completions.create(**GREEDY, logprobs=0, stream=True,
                                                          extra_body={"ignore_eos": True}))
    assert counters(spec_server)[2] > before[2]  # some steps emitted several tokens
    tokens_per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices]
    assert tokens_per_chunk == [1] * 32


def test_inter_token_latency_is_one_gap_per_step_not_zeros_for_accepted_tokens(spec_server: RunningServer) -> None:
    itl = "vivace:inter_token_latency_seconds"
    before = [metric_value(spec_server, f"{itl}_count")] + counters(spec_server)
    spec_server.client().completions.create(**GREEDY, extra_body={"ignore_eos": True})
    after = [metric_value(spec_server, f"{itl}_count")] + counters(spec_server)
    gaps, _, _, accepted = (b - a for a, b in zip(before, after))
    assert accepted > 0 and 31 - accepted <= gaps < 31  # as vLLM's: a verify step is one gap
