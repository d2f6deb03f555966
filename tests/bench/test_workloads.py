"""Workloads: exact prompt lengths with a tokenizer trained here, shared prefixes, JSONL."""

import json
import random

import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from vivace.bench.workloads import (
    PromptFactory, jsonl_prompts, multi_turn_chats, random_prompts, shared_prefix_prompts, single_token_words,
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE (GPT-2 style, like SmolLM2's) trained on random words."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocabulary = ["".join(rng.choices(letters, k=rng.randint(3, 8))) for _ in range(400)]
    corpus = [" ".join(rng.choices(vocabulary, k=50)) for _ in range(400)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=1500, min_frequency=2, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


def test_single_token_words_really_are_one_token(tokenizer) -> None:
    words = single_token_words(tokenizer)
    assert len(words) >= 100 and words == sorted(words)
    assert all(len(tokenizer.encode(word)) == 1 for word in words)


@pytest.mark.parametrize("length", [1, 17, 128, 512])
def test_random_prompts_have_the_exact_length(tokenizer, length) -> None:
    conversations = random_prompts(PromptFactory(tokenizer, seed=1), 5, length, 16)
    assert all(len(tokenizer.encode(c.turns[0])) == length == c.expected_prompt_tokens for c in conversations)
    assert len({c.turns[0] for c in conversations}) == 5
    assert all(c.output_len == 16 for c in conversations)


def test_same_seed_same_prompts(tokenizer) -> None:
    first = random_prompts(PromptFactory(tokenizer, seed=3), 3, 40, 8)
    assert first == random_prompts(PromptFactory(tokenizer, seed=3), 3, 40, 8)
    assert first != random_prompts(PromptFactory(tokenizer, seed=4), 3, 40, 8)


def test_shared_prefix_prompts_share_exactly_the_prefix(tokenizer) -> None:
    conversations = shared_prefix_prompts(PromptFactory(tokenizer, seed=1), 4, 96, 8, prefix_len=64)
    encoded = [tokenizer.encode(c.turns[0]) for c in conversations]
    assert all(len(ids) == 96 for ids in encoded)
    assert all(ids[:64] == encoded[0][:64] for ids in encoded)
    assert len({tuple(ids[64:]) for ids in encoded}) == 4
    with pytest.raises(ValueError):
        shared_prefix_prompts(PromptFactory(tokenizer, seed=1), 1, 64, 8, prefix_len=64)


def test_multi_turn_chats(tokenizer) -> None:
    chats = multi_turn_chats(PromptFactory(tokenizer, seed=1), 2, 3, 20, 8)
    assert len(chats) == 2 and all(len(chat.turns) == 3 for chat in chats)
    assert all(len(tokenizer.encode(turn)) == 20 for chat in chats for turn in chat.turns)


def test_without_a_tokenizer_lengths_are_words() -> None:
    conversation = random_prompts(PromptFactory(None, seed=1), 1, 30, 8)[0]
    assert len(conversation.turns[0].split()) == 30 and conversation.expected_prompt_tokens is None


def test_jsonl_prompts(tmp_path, tokenizer) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": " hello world"}, {"turns": ["a", "b"], "output_len": 5}]
    path.write_text("\n".join(map(json.dumps, lines)) + "\n\n")
    conversations = jsonl_prompts(str(path), PromptFactory(tokenizer, seed=0), 64)
    assert [c.turns for c in conversations] == [(" hello world",), ("a", "b")]
    assert [c.output_len for c in conversations] == [64, 5]
    assert conversations[0].expected_prompt_tokens == len(tokenizer.encode(" hello world"))
    path.write_text(json.dumps({"text": "no prompt"}))
    with pytest.raises(ValueError):
        jsonl_prompts(str(path), PromptFactory(None, seed=0), 64)
