"""Prompt tokenization: the ids ``tokenizer.encode`` gives, sooner.

Most of a transformers encode of a prompt is the Rust tokenizer's, and much of that is the
character offsets of every token, which a server never reads: ``encode_batch_fast`` leaves them
out (512 tokens of prose, about 2.3 -> 1.7 ms on one core). A long prompt is also cut into
pieces at word starts and the pieces encoded in parallel on the tokenizer's thread pool, where
that gives the same ids: a byte-level BPE without a normalizer, whose pre-tokenizer starts a new
piece at a space that follows a non-space and precedes a letter (GPT-2's, Llama 3's, Qwen's
and Mistral's patterns all do), and no added token with a space in it. Every tokenizer is
checked once against ``tokenizer.encode`` on a probe text before either is used for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

from vivace.config import available_cores

# Text that exercises what an encoder could get wrong: runs of spaces, newlines, tabs,
# contractions, digits, punctuation, accents, CJK, an emoji, markup.
_PROBE = ("Hello, world!  It's 3.14159 -- isn't it? We'LL see.\n\nTabs\tand\r\nlines; "
          "an émigré's naïve café, 中文字符 and 🙂 emoji. <b>Bold</b> {\"key\": [1, 22, 333]}   "
          "trailing  spaces\n  indented line x")
# Prompts at least this long (characters; ~400 tokens of prose) are encoded in one piece a
# thread, of at least PIECE_CHARS.
PARALLEL_CHARS = 2048
PIECE_CHARS = 512
_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

Encoder = Callable[[str, bool], list[int]]
T = TypeVar("T")


def once_per_tokenizer(cache: weakref.WeakKeyDictionary, tokenizer, make: Callable[[object], T]) -> T:
    """``make(tokenizer)``, kept in ``cache`` for as long as the tokenizer lives (made each time
    for a tokenizer that can be no weak-dictionary key)."""
    try:
        return cache[tokenizer]
    except KeyError:
        made = cache[tokenizer] = make(tokenizer)
        return made
    except TypeError:
        return make(tokenizer)


def encoder_of(tokenizer) -> Encoder:
    """``encode(text, add_special_tokens)``: the ids of ``tokenizer.encode(text,
    add_special_tokens=...)``, from the fast tokenizer's Rust encode without offsets (long
    texts in parallel pieces) where that was checked to give them, else ``tokenizer.encode``."""
    encoder = once_per_tokenizer(_ENCODERS, tokenizer, _fast_encoder)
    return encoder or (lambda text, add_special_tokens: tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _fast_encoder(tokenizer) -> Encoder | None:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast") or backend.truncation or backend.padding:
        return None
    try:
        from tokenizers import Encoding

        def whole(text: str, add_special_tokens: bool) -> list[int]:
            return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

        def in_pieces(text: str, add_special_tokens: bool, piece_chars: int = PIECE_CHARS) -> list[int]:
            pieces = word_pieces(text, piece_chars)
            if len(pieces) < 2:
                return whole(text, add_special_tokens)
            merged = Encoding.merge(backend.encode_batch_fast(pieces, add_special_tokens=False))
            return backend.post_process(merged, None, add_special_tokens).ids if add_special_tokens else merged.ids

        def same(encode: Callable[..., list[int]], **kwargs: int) -> bool:
            return all(encode(_PROBE, add, **kwargs) == tokenizer.encode(_PROBE, add_special_tokens=add)
                       for add in (True, False))

        if not same(whole):
            return None
        if not (_piecewise_safe(tokenizer, backend) and same(in_pieces, piece_chars=8)):
            return whole

        def encode(text: str, add_special_tokens: bool) -> list[int]:
            if len(text) < PARALLEL_CHARS:
                return whole(text, add_special_tokens)
            return in_pieces(text, add_special_tokens, max(PIECE_CHARS, -(-len(text) // available_cores())))
        return encode
    except Exception:  # a tokenizer of another make: its own encode
        return None


def _piecewise_safe(tokenizer, backend) -> bool:
    """Whether encoding word-start pieces apart can give the whole text's ids: a BPE model, no
    normalizer (one like Llama 2's prepends a space to whatever it is given), a byte-level
    pre-tokenizer (one ``ByteLevel``, or a ``Sequence`` of regex ``Split``s before one), and
    no added token with a space in its text (added tokens are matched in the raw text, a piece
    could cut one)."""
    if type(backend.model).__name__ != "BPE" or backend.normalizer is not None:
        return False
    names = [type(backend.pre_tokenizer).__name__]
    if names == ["Sequence"]:
        names = [type(part).__name__ for part in backend.pre_tokenizer]
    if names[-1:] != ["ByteLevel"] or any(name not in ("Split", "ByteLevel") for name in names):
        return False
    return not any(any(c.isspace() for c in token.content)
                   for token in backend.get_added_tokens_decoder().values())


def word_pieces(text: str, piece_chars: int) -> list[str]:
    """``text`` cut, about every ``piece_chars`` characters, before a space that follows a
    non-space and precedes a letter (a word's start, where byte-level pre-tokenizers begin a new
    piece anyway); the pieces join back to ``text``."""
    cuts, at = [0], piece_chars
    while at < len(text) - piece_chars // 2:
        at = text.find(" ", at)
        if at < 0:
            break
        if at + 1 < len(text) and text[at + 1].isalpha() and not text[at - 1].isspace():
            cuts.append(at)
            at += piece_chars
        else:
            at += 1
    cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
