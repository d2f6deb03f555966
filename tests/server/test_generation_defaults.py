"""The model's recommended sampling defaults reach the engine through a real server: a tiny random
model whose generation_config.json says ``top_k: 1`` samples greedily at temperature 1, and its
``max_new_tokens`` is the max_tokens of a request that gives none; a request's own values,
``--generation-config vllm`` and ``--override-generation-config`` each undo that, as vLLM's flags do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


from .harness import RunningServer, serving_command_line

MAX_NEW_TOKENS = 6
QUESTION = "Name a colour."
MESSAGES = [{"role": "user", "content": QUESTION}]
KEEP_GOING = {"ignore_eos": True}  # every answer runs to its max_tokens


@pytest.fixture(scope="module")
def recommending_model(make_tiny_llama) -> Path:
    """A tiny random Llama whose generation config recommends greedy decoding (top_k 1)."""
    model = make_tiny_llama(seed=3)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**config, "do_sample": True, "top_k": 1, "max_new_tokens": MAX_NEW_TOKENS}))
    return model


@pytest.fixture(scope="module")
def auto_server(recommending_model: Path) -> Iterator[RunningServer]:
    with serving_command_line(recommending_model) as running:
        yield running


def _chat(server: RunningServer, **options: Any) -> tuple[str, int]:
    """The answer to MESSAGES (seed 7) and its completion tokens; ``options`` the client's, extras in extra_body."""
    extra = {**KEEP_GOING, **options.pop("extra", {})}
    reply = server.client().chat.completions.create(model="tiny", messages=MESSAGES, seed=7, extra_body=extra,
                                                    **options)
    return reply.choices[0].message.content or "", reply.usage.completion_tokens


def _completion(server: RunningServer, **options: Any) -> tuple[str, int]:
    reply = server.client().completions.create(model="tiny", prompt=QUESTION, seed=7, extra_body=KEEP_GOING,
                                               **options)
    return reply.choices[0].text, reply.usage.completion_tokens


def test_the_models_top_k_makes_temperature_1_greedy_and_its_max_new_tokens_the_max_tokens(
        auto_server: RunningServer) -> None:
    greedy = _chat(auto_server, temperature=0, max_tokens=MAX_NEW_TOKENS)
    assert _chat(auto_server, temperature=1.0) == greedy  # top_k 1 from the file; max_tokens its max_new_tokens
    assert _chat(auto_server) == greedy
    sampled, tokens = _chat(auto_server, temperature=1.0, max_tokens=MAX_NEW_TOKENS, extra={"top_k": 0})
    assert tokens == MAX_NEW_TOKENS and sampled != greedy[0]  # the request's own top_k wins
    assert _chat(auto_server, temperature=1.0, max_tokens=3)[1] == 3


def test_completions_and_the_responses_api_take_the_defaults_too(auto_server: RunningServer) -> None:
    greedy = _completion(auto_server, temperature=0, max_tokens=MAX_NEW_TOKENS)
    assert _completion(auto_server, temperature=1.0) == greedy  # not 16 tokens: the model's max_new_tokens
    assert _completion(auto_server, temperature=1.0, max_tokens=16)[1] == 16
    answer = auto_server.client().responses.create(model="tiny", input=QUESTION, temperature=1.0,
                                                   extra_body=KEEP_GOING)
    assert answer.output_text == _chat(auto_server, temperature=0, max_tokens=MAX_NEW_TOKENS)[0]
    assert answer.usage.output_tokens == MAX_NEW_TOKENS
    assert (answer.temperature, answer.top_p) == (1.0, 1.0)


def test_generation_config_vllm_turns_the_models_defaults_off(recommending_model: Path) -> None:
    with serving_command_line(recommending_model, "--generation-config", "vllm") as server:
        greedy = _chat(server, temperature=0, max_tokens=MAX_NEW_TOKENS)
        assert _chat(server, temperature=1.0, max_tokens=MAX_NEW_TOKENS)[0] != greedy[0]
        assert _completion(server, temperature=0)[1] == 16  # OpenAI's default, as without a generation config


def test_the_override_wins_over_the_models_file(recommending_model: Path) -> None:
    override = json.dumps({"top_k": 0, "max_new_tokens": 3})
    with serving_command_line(recommending_model, "--override-generation-config", override) as server:
        greedy = _chat(server, temperature=0)
        assert greedy[1] == 3
        assert _chat(server, temperature=1.0)[0] != greedy[0]
