"""Predicted outputs over HTTP with the official client: the same answer whatever the prediction,
on a server without speculation and on one with n-gram speculation; the usage's accepted and
rejected prediction tokens, whole and streamed; requests that may not speculate; bad bodies."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from vivace.config import EngineConfig
from vivace.server import ServerSettings

from .harness import RunningServer, assert_engine_idle, metric_value, serving_own_engine

FILE = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"
MESSAGES = [{"role": "user", "content": f"Rewrite this file, renaming area to surface:\n\n{FILE}"}]
GREEDY = dict(model="tiny", messages=MESSAGES, max_tokens=48, temperature=0)


@pytest.fixture(scope="module")
def model_dir(make_tiny_llama) -> Path:
    """A tiny random Llama whose greedy output wanders (see tests/engine/test_prediction.py)."""
    return make_tiny_llama(initializer_range=0.3)


def served(model_dir: Path, speculative: str | None) -> Iterator[RunningServer]:
    config = EngineConfig(model=str(model_dir), max_model_len=512, num_kv_blocks=128, max_num_seqs=8,
                          speculative=speculative)
    with serving_own_engine(config, ServerSettings(served_model_name="tiny")) as running:
        yield running


@pytest.fixture(scope="module", params=[None, "ngram"], ids=["plain", "ngram"])
def any_server(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    yield from served(model_dir, request.param)


@pytest.fixture(scope="module")
def plain_server(model_dir: Path) -> Iterator[RunningServer]:
    yield from served(model_dir, None)


@pytest.fixture(autouse=True)
def _servers_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("any_server", "plain_server"):
        if name in request.fixturenames:
            assert_engine_idle(request.getfixturevalue(name).engine)


def predictions(expected: str) -> dict[str, object]:
    """Equal to the answer (also as text parts), different in its middle, unrelated, empty."""
    third = len(expected) // 3
    return {"equal": expected, "parts": [{"type": "text", "text": expected[:third]},
                                         {"type": "text", "text": expected[third:]}],
            "middle": expected[:third] + " something else entirely " + expected[2 * third:],
            "unrelated": FILE * 3, "empty": ""}


def test_the_answer_is_the_same_whatever_the_prediction(any_server: RunningServer) -> None:
    client = any_server.client()
    plain = client.chat.completions.create(**GREEDY)
    expected = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction, no details
    accepted = {}
    for kind, content in predictions(expected).items():
        reply = client.chat.completions.create(**GREEDY, prediction={"type": "content", "content": content})
        assert reply.choices[0].message.content == expected, kind
        details, completion = reply.usage.completion_tokens_details, reply.usage.completion_tokens
        assert completion == plain.usage.completion_tokens
        assert 0 <= details.accepted_prediction_tokens < completion
        accepted[kind] = details.accepted_prediction_tokens
    assert accepted["equal"] >= plain.usage.completion_tokens // 2 and accepted["parts"] == accepted["equal"]
    assert accepted["empty"] == 0 and accepted["middle"] > 0


def test_streamed_usage_counts_the_prediction(plain_server: RunningServer) -> None:
    client = plain_server.client()
    expected = client.chat.completions.create(**GREEDY).choices[0].message.content
    whole = client.chat.completions.create(**GREEDY, prediction={"type": "content", "content": expected})
    before = [metric_value(plain_server, f"vivace:{kind}_prediction_tokens_total") for kind in ("accepted", "rejected")]
    chunks = list(client.chat.completions.create(**GREEDY, prediction={"type": "content", "content": expected},
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    usage = chunks[-1].usage
    assert usage.completion_tokens_details == whole.usage.completion_tokens_details
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0
    after = [metric_value(plain_server, f"vivace:{kind}_prediction_tokens_total") for kind in ("accepted", "rejected")]
    assert [b - a for a, b in zip(before, after)] == [usage.completion_tokens_details.accepted_prediction_tokens,
                                                      usage.completion_tokens_details.rejected_prediction_tokens]


@pytest.mark.parametrize("ruled_out", [{"speculative": False}, {"presence_penalty": 0.5}])
def test_a_request_that_may_not_speculate_is_served_normally(plain_server: RunningServer, ruled_out: dict) -> None:
    client = plain_server.client()
    extra = {"extra_body": ruled_out}
    expected = client.chat.completions.create(**GREEDY, **extra).choices[0].message.content
    reply = client.chat.completions.create(**GREEDY, **extra, prediction={"type": "content", "content": expected})
    assert reply.choices[0].message.content == expected
    details = reply.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0


def test_a_mixed_batch_gives_each_request_its_answer(any_server: RunningServer) -> None:
    client = any_server.client()
    asks = [[{"role": "user", "content": f"Rewrite this file, renaming area to {name}:\n\n{FILE}"}]
            for name in ("surface", "size", "extent", "span")]
    expected = [client.chat.completions.create(**{**GREEDY, "messages": m}).choices[0].message.content for m in asks]

    def ask(i: int) -> str:
        prediction = {"prediction": {"type": "content", "content": expected[i]}} if i % 2 == 0 else {}
        return client.chat.completions.create(**{**GREEDY, "messages": asks[i]}, **prediction).choices[0].message.content

    with ThreadPoolExecutor(len(asks)) as pool:
        assert list(pool.map(ask, range(len(asks)))) == expected


@pytest.mark.parametrize("prediction", [
    {"type": "text", "content": "x"}, {"type": "content"}, {"type": "content", "content": 5},
    {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
    {"type": "content", "content": "x", "extra": 1}, "just text"])
def test_a_bad_prediction_is_a_400_naming_it(plain_server: RunningServer, prediction: object) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        plain_server.client().chat.completions.create(**GREEDY, prediction=prediction)
    assert "prediction" in str(error.value)


def test_text_completions_have_no_prediction(plain_server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        plain_server.client().completions.create(model="tiny", prompt="def area", max_tokens=4,
                                                 extra_body={"prediction": {"type": "content", "content": "x"}})
    assert "prediction" in str(error.value)
