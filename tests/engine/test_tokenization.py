"""vivace.engine.tokenization: the fast encoder gives ``tokenizer.encode``'s ids, long texts cut
into pieces included, on the default tokenizer and on tokenizers built here of other kinds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from vivace.engine import tokenization
from vivace.engine.tokenization import PARALLEL_CHARS, encoder_of, word_pieces

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
WORDS = ["the", "whale", "Ishmael", "naïve", "émigré", "中文", "🙂", "don't", "WE'LL", "3.14", "42", "x", "<b>",
         "{\"k\":", "[1,", "--", "...", "\t", "\n", "\n\n", "  ", "   ", "\r\n", "a-b", "it's"]


def random_texts(seed: int, count: int = 6) -> list[str]:
    """Texts over PARALLEL_CHARS long (so they are cut) of words, numbers, markup, odd whitespace."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        while sum(map(len, parts)) < PARALLEL_CHARS * rng.choice([1.2, 2, 5]):
            parts.append(rng.choice(WORDS) + rng.choice([" ", " ", " ", "", "  ", "\n", ", "]))
        texts.append(rng.choice(["", " ", "\n"]) + "".join(parts))
    return texts


def assert_same_ids(tokenizer, texts: list[str]) -> None:
    encode = encoder_of(tokenizer)
    for text in texts:
        for add in (True, False):
            assert encode(text, add) == tokenizer.encode(text, add_special_tokens=add), (text[:80], add)


def trained(pre_tokenizer, normalizer=None, post_processor=None) -> transformers.PreTrainedTokenizerFast:
    """A small byte-level BPE trained here (a few hundred merges), wrapped as transformers wraps one."""
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(random_texts(0, 4), trainer)
    if post_processor is not None:
        backend.post_processor = post_processor
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>")


def test_word_pieces_cut_at_word_starts_and_join_back() -> None:
    for text in random_texts(1):
        pieces = word_pieces(text, 300)
        assert "".join(pieces) == text and len(pieces) > 1
        for piece in pieces[1:]:
            assert piece[0] == " " and piece[1].isalpha()
    assert word_pieces("no-spaces-at-all" * 100, 100) == ["no-spaces-at-all" * 100]


def test_default_tokenizer_encodes_in_pieces_as_transformers(default_tokenizer_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    assert tokenization._piecewise_safe(tokenizer, tokenizer._tokenizer)
    monkeypatch.setattr(tokenization, "available_cores", lambda: 8)  # several pieces even on a 2-core machine
    texts = random_texts(2) + [(Path(__file__).parents[1] / "data" / "moby_dick_loomings.txt").read_text()]
    assert_same_ids(tokenizer, texts)
    # The chat template's special tokens, as a chat prompt carries them.
    chat = tokenizer.apply_chat_template([{"role": "user", "content": texts[0]}], tokenize=False,
                                         add_generation_prompt=True)
    assert_same_ids(tokenizer, [chat])


def test_llama3_style_tokenizer_with_bos(monkeypatch: pytest.MonkeyPatch) -> None:
    """A regex Split before a ByteLevel without its own regex (Llama 3, Qwen2), BOS added by a template."""
    tokenizer = trained(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    assert tokenization._piecewise_safe(tokenizer, tokenizer._tokenizer)
    monkeypatch.setattr(tokenization, "available_cores", lambda: 8)
    texts = random_texts(3)
    assert_same_ids(tokenizer, texts)
    ids = encoder_of(tokenizer)(texts[0], True)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]


def test_tokenizers_not_safe_to_cut_keep_whole_encodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A normalizer that prepends a space (Llama 2's) or an added token with a space in it: never
    cut, still the same ids."""
    monkeypatch.setattr(tokenization, "available_cores", lambda: 8)
    prepending = trained(pre_tokenizers.ByteLevel(add_prefix_space=False),
                         normalizer=normalizers.Prepend(" "))
    assert not tokenization._piecewise_safe(prepending, prepending._tokenizer)
    spaced = trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    spaced.add_tokens(["the whale"])
    assert not tokenization._piecewise_safe(spaced, spaced._tokenizer)
    for tokenizer in (prepending, spaced):
        assert_same_ids(tokenizer, random_texts(4, 3) + ["Call me the whale, Ishmael. " * 100])


def test_tokenizer_without_a_rust_backend_uses_its_own_encode() -> None:
    class Words:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [len(word) for word in text.split()] + ([0] if add_special_tokens else [])

    words = Words()
    assert encoder_of(words)("call me Ishmael", True) == [4, 2, 7, 0]
    assert encoder_of(words)("call me Ishmael", False) == [4, 2, 7]
