"""Incremental detokenization and stop strings.

Text is decoded over a small window of recent tokens, so a token that completes a
multi-byte character is emitted together with it and never as a broken "\ufffd".
Text that could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from vivace.engine.stop_strings import StopStrings
from vivace.engine.tokenization import once_per_tokenizer

# Decoding a few tokens before the new ones gives tokenizers the context they need
# for leading spaces (sentencepiece) and byte-level merges.
_CONTEXT_TOKENS = 5

# Text on which transformers' clean-up of decoded spaces (" ," to ",", " n't" to "n't", ...)
# would change something: where its decode gives what the Rust tokenizer alone gives for it, it
# does no clean-up, and the Rust decode is its decode.
_CLEAN_UP_PROBE = "Hello , world . Is n't it ? I 'm sure ! It 's done , we 've seen , they 're here ."
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_of(tokenizer) -> Callable[[list[int], bool], str]:
    """``decode(ids, skip_special_tokens)`` as ``tokenizer.decode`` gives it: the fast tokenizer's
    Rust decode straight where that is the same (no clean-up of spaces; most of a transformers
    decode of a few ids is its Python around that call), else ``tokenizer.decode``. The check runs
    once per tokenizer."""
    backend = once_per_tokenizer(_DECODERS, tokenizer, _rust_decoder)
    if backend is not None:
        return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _rust_decoder(tokenizer) -> object | None:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` if its decode is ``tokenizer.decode``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    try:
        probe = tokenizer.encode(_CLEAN_UP_PROBE, add_special_tokens=False)
        probe += [i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None]
        same = all(backend.decode(probe, skip_special_tokens=skip) == tokenizer.decode(probe, skip_special_tokens=skip)
                   for skip in (True, False))
    except Exception:  # a tokenizer of another make: its own decode
        return None
    return backend if same else None


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    token_ids: list[int]
    stop: list[str] | StopStrings  # a list is indexed here
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    text: str = ""          # everything decoded so far (cut at a stop string if one matched)
    num_emitted: int = 0    # characters of ``text`` already handed out
    prefix_offset: int = field(init=False)
    read_offset: int = field(init=False)

    def __post_init__(self) -> None:
        self._decoder = decoder_of(self.tokenizer)
        self.token_ids = list(self.token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)
        self.stops = self.stop if isinstance(self.stop, StopStrings) else StopStrings(self.stop)
        self._held = 0     # characters at the end of ``text`` that could begin a stop string
        self._checked = 0  # ``text`` up to here was searched for stop strings

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, self.skip_special_tokens)

    def add_token(self, token_id: int, match_stop: bool = True) -> str | None:
        """Append a token; return the stop string it completed, if any (and if asked)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        start = len(self.text)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        stop = self._match_stop(start) if match_stop else None
        if stop is None:  # a suffix that could begin a stop string extends the one before it
            self._held = self.stops.held_back(self.text, self._held + len(self.text) - start)
        return stop

    def _match_stop(self, new_start: int) -> str | None:
        """The stop string that now ends the output, as a search from ``longest - 1`` characters
        before the new text finds it (the earliest; on a tie, the first listed), with ``text`` cut
        there. Only occurrences that end in text not yet searched can be new; each that begins
        before the new text does so inside what was held back."""
        search_from = max(new_start - self.stops.longest + 1, 0)
        starts_from = max(new_start - self._held, search_from) if self._checked == new_start else search_from
        match = self.stops.first_match(self.text, self._checked, starts_from)
        self._checked = len(self.text)
        if match is None:
            return None
        at, stop = match
        self._cut(at + len(stop) if self.include_stop_str_in_output else at)
        return stop

    def _cut(self, end: int) -> None:
        self.text = self.text[:end]
        self._checked = min(self._checked, end)
        self._held = self.stops.held_back(self.text, self.stops.longest)

    def take_new_text(self, final: bool) -> str:
        """Text not yet handed out; while not final, keep back a possible stop-string start."""
        end = len(self.text) if final else len(self.text) - self._held
        end = max(end, self.num_emitted)
        delta = self.text[self.num_emitted:end]
        self.num_emitted = end
        return delta
