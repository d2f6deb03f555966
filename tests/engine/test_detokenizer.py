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
