import random
import sys

import pytest
import transformers

from vivace.engine.detokenizer import IncrementalDetokenizer

TEXT = "Grüße aus Köln! 東京タワー 🎉🚀 naïve café — ok"


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)


def stream(tokenizer, text: str, stop: list[str]) -> tuple[list[str], str | None]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    pieces, matched = [], None
    for token_id in ids:
        matched = detok.add_token(token_id)
        pieces.append(detok.take_new_text(final=matched is not None))
        if matched:
            break
    else:
        pieces.append(detok.take_new_text(final=True))
    return pieces, matched


def test_multibyte_characters_are_never_split(tokenizer):
    pieces, _ = stream(tokenizer, TEXT, [])
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == TEXT
    # Some emoji take several tokens: a step must have emitted nothing rather than half of one.
    assert "" in pieces


@pytest.mark.parametrize("stop", ["Köln", "タワー", "🚀", " ok", "aus K"])
def test_stop_string_is_cut_exactly_and_never_emitted(tokenizer, stop):
    pieces, matched = stream(tokenizer, TEXT, [stop, "never-there"])
    assert matched == stop
    assert "".join(pieces) == TEXT[:TEXT.index(stop)]


def test_text_resembling_a_stop_string_is_released_once_it_diverges(tokenizer):
    pieces, matched = stream(tokenizer, TEXT, ["Köln?"])
    assert matched is None
    assert "".join(pieces) == TEXT


def test_the_rust_decode_stands_in_only_where_it_is_the_tokenizers_decode(tokenizer):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from vivace.engine.detokenizer import _rust_decoder, decoder_of

    # The default tokenizer (byte-level BPE): transformers cleans no spaces up, so its Rust decode stands in.
    assert _rust_decoder(tokenizer) is tokenizer._tokenizer
    decode = decoder_of(tokenizer)
    ids = tokenizer.encode(TEXT + " Hello , world . Is n't it ?", add_special_tokens=False) + [tokenizer.eos_token_id]
    for start in range(0, len(ids) - 5):
        for skip in (True, False):
            assert decode(ids[start:start + 6], skip) == tokenizer.decode(ids[start:start + 6], skip_special_tokens=skip)
    # A WordPiece tokenizer with transformers' clean-up of spaces on keeps its own decode.
    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, ",": 2, "world": 3, ".": 4}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)  # the clean-up left to transformers
    wordpiece = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                                     clean_up_tokenization_spaces=True)
    assert _rust_decoder(wordpiece) is None
    assert decoder_of(wordpiece)([1, 2, 3, 4], True) == wordpiece.decode([1, 2, 3, 4]) == "hello, world."


class PieceTokenizer:
    """Token i decodes to ``pieces[i]``, whatever its neighbours: text arrives a piece at a time."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


class NaiveStops:
    """The stop-string rules by definition: every stop searched from ``longest - 1`` characters
    before the new text, every suffix length held back against every stop."""

    def __init__(self, stop: list[str], include: bool) -> None:
        self.stop, self.include, self.text, self.emitted = stop, include, "", 0

    def add(self, piece: str, match: bool) -> str | None:
        start, self.text = len(self.text), self.text + piece
        if not match:
            return None
        longest = max((len(s) for s in self.stop), default=0)
        found = [(self.text.find(s, max(start - longest + 1, 0)), i) for i, s in enumerate(self.stop)]
        found = [f for f in found if f[0] != -1]
        if not found:
            return None
        at, i = min(found)
        self.text = self.text[:at + len(self.stop[i]) if self.include else at]
        return self.stop[i]

    def take(self, final: bool) -> str:
        held = 0
        for n in range(min(max((len(s) for s in self.stop), default=1) - 1, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stop):
                held = n
                break
        end = max(len(self.text) if final else len(self.text) - held, self.emitted)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta


@pytest.mark.parametrize("seed", range(40))
def test_stop_strings_match_and_hold_back_as_the_definition_says(seed):
    """Random outputs over a small alphabet (many near misses, overlaps, nested and repeated stop
    strings, min_tokens' unmatched start, include_stop_str_in_output): the indexed search finds
    what searching every stop string finds, and holds back what checking every suffix holds back."""
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc "
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 12))]
    pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    include, unmatched = bool(seed % 3), rng.choice([0, 0, 5, 30])
    detok = IncrementalDetokenizer(PieceTokenizer(pieces), [], list(stops), include_stop_str_in_output=include)
    naive = NaiveStops(stops, include)
    for step, token_id in enumerate(rng.sample(range(len(pieces)), len(pieces))):
        matched = detok.add_token(token_id, match_stop=step >= unmatched)
        assert matched == naive.add(pieces[token_id], step >= unmatched)
        assert detok.take_new_text(matched is not None) == naive.take(matched is not None)
        if matched:
            break
    assert detok.text == naive.text


def c_calls_per_token(detok: IncrementalDetokenizer, token_ids: list[int]) -> float:
    """Calls into C functions (str methods, bisection...) that adding each token makes, on average."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "c_call"
    sys.setprofile(count)
    try:
        for token_id in token_ids:
            detok.add_token(token_id)
            detok.take_new_text(final=False)
    finally:
        sys.setprofile(None)
    return calls / len(token_ids)


@pytest.mark.parametrize("case", ["random", "near miss"])
def test_many_long_stop_strings_cost_each_token_a_bounded_number_of_calls(case):
    """1,000 stop strings of 1,000 characters: checking a token must not touch each of them
    (that cost every stream ~90 ms per token of this request), also while the output runs along
    a long common beginning of them all."""
    rng = random.Random(0)
    if case == "random":
        stops = ["".join(rng.choice("abcdefghij ") for _ in range(1000)) for _ in range(1000)]
        pieces = [rng.choice("abcdefghij ") + rng.choice("abcdefghij ") for _ in range(2000)]
    else:  # every stop begins with 999 "a"s: the output "aaa..." is held back a long way
        stops = ["a" * 999 + chr(0x4e00 + i) for i in range(1000)]
        pieces = ["a"] * 2000
    detok = IncrementalDetokenizer(PieceTokenizer(pieces), [], stops)
    for token_id in range(1500):  # past the longest stop string's length
        assert detok.add_token(token_id) is None
        detok.take_new_text(final=False)
    assert c_calls_per_token(detok, list(range(1500, 1503))) < 200
