"""Prompt sets for the benchmark: random prompts of an exact token length, prompts that
share a prefix, multi-turn chats, and JSONL files.

Every workload is a list of `Conversation`s; a single-shot request is a conversation of
one turn. Exact lengths need the server's tokenizer (`--tokenizer`); without it a prompt
of N tokens is N common English words, close to but not exactly N tokens.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

_WORD = re.compile(r"^ [a-z]{3,10}$")
_FALLBACK_WORDS = tuple(
    " " + word
    for word in """time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work government
    number night point home water room mother area money story fact month lot right study book eye job
    word business issue side kind head house service friend father power hour game line end member law
    car city name""".split()
)


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the workloads use."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Conversation:
    """User turns sent one after another, each after the reply to the previous one;
    `expected_prompt_tokens` is the exact token count of the first turn's prompt when
    it is known (the server's `usage.prompt_tokens` must then equal it)."""

    turns: tuple[str, ...]
    output_len: int
    expected_prompt_tokens: int | None = None


@functools.cache
def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer from a Hugging Face directory or a GGUF file (transformers is
    imported only here), loaded once per process (a 262k-token GGUF vocabulary takes
    seconds). Raises OSError or ValueError when it cannot be loaded."""
    from transformers import AutoTokenizer

    location = Path(path)
    if location.is_file():
        return AutoTokenizer.from_pretrained(str(location.parent), gguf_file=location.name)
    return AutoTokenizer.from_pretrained(str(location))


class PromptFactory:
    """Random prompts built from words that are one token each, so that a prompt's
    length is exact; `count` is None without a tokenizer (lengths are then approximate)."""

    def __init__(self, tokenizer: Tokenizer | None, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.words = single_token_words(tokenizer) if tokenizer else list(_FALLBACK_WORDS)

    def count(self, text: str) -> int | None:
        """Tokens the server should count for `text` as a whole prompt (special tokens
        such as BOS included), or None without a tokenizer."""
        return len(self.tokenizer.encode(text)) if self.tokenizer else None

    def extend(self, prefix: str, num_tokens: int) -> str:
        """`prefix` followed by random words, `num_tokens` tokens in all. Raises
        ValueError when the prefix is already longer or the length cannot be hit."""
        words: list[str] = []
        for _ in range(20):
            text = prefix + "".join(words)
            have = self.count(text)
            if have is None:
                have = len(prefix.split()) + len(words)
            if have == num_tokens:
                return text
            if have < num_tokens:
                words += self.rng.choices(self.words, k=num_tokens - have)
            elif words:
                del words[num_tokens - have :]
            else:
                break
        raise ValueError(f"cannot build a prompt of exactly {num_tokens} tokens from {prefix[:40]!r}")


def single_token_words(tokenizer: Tokenizer) -> list[str]:
    """Lowercase words with a leading space that the tokenizer encodes as one token,
    sorted so that a seed picks the same prompts on every machine."""
    words = set()
    for token_id in tokenizer.get_vocab().values():
        text = tokenizer.decode([token_id])
        if _WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.add(text)
    if len(words) < 100:
        raise ValueError(f"tokenizer has only {len(words)} single-token words; cannot build exact prompts")
    return sorted(words)


def random_prompts(factory: PromptFactory, count: int, input_len: int, output_len: int) -> list[Conversation]:
    """`count` one-turn conversations with random prompts of `input_len` tokens."""
    return shared_prefix_prompts(factory, count, input_len, output_len, prefix_len=0)


def shared_prefix_prompts(
    factory: PromptFactory, count: int, input_len: int, output_len: int, prefix_len: int
) -> list[Conversation]:
    """`count` one-turn prompts of `input_len` tokens whose first `prefix_len` tokens
    are the same for all of them."""
    if not 0 <= prefix_len < input_len:
        raise ValueError(f"prefix length {prefix_len} must be below the input length {input_len}")
    prefix = factory.extend("", prefix_len) if prefix_len else ""
    prompts = [factory.extend(prefix, input_len) for _ in range(count)]
    expected = input_len if factory.tokenizer else None
    return [Conversation((prompt,), output_len, expected) for prompt in prompts]


def multi_turn_chats(
    factory: PromptFactory, count: int, turns: int, input_len: int, output_len: int
) -> list[Conversation]:
    """`count` conversations of `turns` user messages of `input_len` tokens each; the
    history (earlier messages and replies) grows with every turn."""
    conversations = []
    for _ in range(count):
        messages = tuple(factory.extend("", input_len) for _ in range(turns))
        conversations.append(Conversation(messages, output_len, input_len if factory.tokenizer else None))
    return conversations


def jsonl_prompts(path: str, factory: PromptFactory, default_output_len: int) -> list[Conversation]:
    """Conversations from a JSONL file: each line holds `"prompt": str` or
    `"turns": [str, ...]`, and optionally `"output_len": int`. Raises ValueError on a
    line that has neither."""
    conversations = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        turns = record.get("turns") or ([record["prompt"]] if "prompt" in record else None)
        if not turns or not all(isinstance(turn, str) for turn in turns):
            raise ValueError(f"{path}:{number}: needs a string 'prompt' or a list of strings 'turns'")
        output_len = int(record.get("output_len", default_output_len))
        conversations.append(Conversation(tuple(turns), output_len, factory.count(turns[0])))
    return conversations
