"""A stream carries one event per sampled token, even for tokens that add no text yet.

The case that showed it: a dummy Llama-3.1-8B (vocabulary 128,256) served with the default
tokenizer (49,152 ids) on a GPU. Ids past the tokenizer decode to nothing, so about 60% of the
tokens sent no event: 128 tokens arrived as ~50 chunks and the ITL median was two 5 ms steps.
Structure only is asserted here (counts, not milliseconds), on a tiny model of that vocabulary."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from vivace.config import EngineConfig
from vivace.server import ServerSettings

from .harness import RunningServer, assert_engine_idle, serving_own_engine

# Llama 3's vocabulary at a tiny width: most ids it samples are unknown to the default tokenizer.
WIDE_VOCAB = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=64,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
TOKENS = 48


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    directory = tmp_path_factory.mktemp("wide-vocab")
    (directory / "config.json").write_text(json.dumps(WIDE_VOCAB))
    config = EngineConfig(model=str(directory), load_format="dummy", device="cpu", num_kv_blocks=32, max_num_seqs=4)
    with serving_own_engine(config, ServerSettings(served_model_name="wide")) as running:
        yield running
        assert_engine_idle(running.engine)


def _request(api: str) -> dict:
    common = dict(model="wide", max_tokens=TOKENS, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if api == "chat":
        return {**common, "messages": [{"role": "user", "content": "Tell me a story"}]}
    return {**common, "prompt": "Once upon a time"}


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_every_token_is_its_own_event(wide_server: RunningServer, api: str) -> None:
    client = wide_server.client()
    create = client.chat.completions.create if api == "chat" else client.completions.create
    chunks = list(create(**_request(api)))
    if api == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"
        chunks = chunks[1:]
        pieces = [c.choices[0].delta.content for c in chunks if c.choices]
    else:
        pieces = [c.choices[0].text for c in chunks if c.choices]
    assert chunks[-1].usage.completion_tokens == TOKENS
    assert len(pieces) == TOKENS, f"{TOKENS} tokens came in {len(pieces)} events"
    assert "" in pieces  # the case at issue was met: a token with no text of its own still got its event
    assert any(pieces)
