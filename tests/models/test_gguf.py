"""GGUF files written the way llama.cpp writes them load back to transformers' logits."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import transformers

from vivace.models import load_model
from vivace.models.gguf import open_gguf
from vivace.models.gguf_file import GGUFFile, dequantize_blocks
from vivace.models.loader import default_model_path

from .gguf_export import SPM_TOKENS, write_gguf
from .test_llama import assert_close
from .tiny import CHAT_TEMPLATE, EOS_ID, KINDS, TOKENS, PagedRun, hf_logits, prompt, tiny_model, tiny_tokenizer

F32, F16, Q1_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q1_0
# llama.cpp has no window for its llama arch, and a fixed Gemma 3 layer pattern and attention scale.
GGUF_LESS = ("mistral_sliding", "gemma3_pattern2")


@pytest.mark.parametrize("ggml_type", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in GGUF_LESS])
def test_gguf_logits_match_original_weights(tiny, tmp_path, kind: str, ggml_type) -> None:
    model = tiny(kind)
    path = write_gguf(model.hf, tmp_path / f"{kind}.gguf", ggml_type)
    loaded = load_model(str(path), torch.float32)
    ids = prompt(21, seed=6)
    run = PagedRun(loaded.model, loaded.config)
    expected = hf_logits(model.hf, ids)
    assert_close(run.step({"a": ids[:17]})["a"], expected[:17])
    for pos in range(17, len(ids)):
        assert_close(run.step({"a": [ids[pos]]})["a"], expected[pos:pos + 1])


@pytest.mark.parametrize("ggml_type", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1],
                         ids=["q8_0", "q4_1"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_quantized_gguf_matches_transformers_gguf_loading(tiny, tmp_path, kind: str, ggml_type) -> None:
    path = write_gguf(tiny(kind).hf, tmp_path / "model.gguf", ggml_type)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    loaded = load_model(str(path), torch.float32)
    ids = prompt(16, seed=7)
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], hf_logits(reference, ids))


def test_gguf_config_and_tokenizer(tiny, tmp_path) -> None:
    path = write_gguf(tiny("llama3_rope").hf, tmp_path / "tiny-llama3.gguf")
    loaded = load_model(str(path), torch.float32)
    assert loaded.name == "tiny-llama3"
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.config.eos_token_ids == (EOS_ID, TOKENS.index("<|endoftext|>"))  # llama.cpp stops at both
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert isinstance(loaded.tokenizer, transformers.PreTrainedTokenizerFast)
    text = "the hello world <|im_end|>\n"
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == tiny_tokenizer().encode(text)


def test_a_chat_ggufs_turn_end_stops_whatever_its_eos(tiny, tmp_path) -> None:
    """Chat GGUFs often name the end of text as EOS while their template ends turns with another
    control token (Gemma 3's <end_of_turn>, Phi-3's <|end|>): llama.cpp stops at both, and so must
    we, or the answer runs on into made-up turns."""
    end_of_text = TOKENS.index("<|endoftext|>")
    path = write_gguf(tiny("llama").hf, tmp_path / "chat.gguf", eos_id=end_of_text)
    assert load_model(str(path), torch.float32).config.eos_token_ids == (end_of_text, EOS_ID)


@pytest.mark.parametrize("ggml_type", [F32, gguf.GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("kind", ["llama_bias", "qwen2"])
def test_fused_qkv_gguf_matches_original_weights(tiny, tmp_path, kind: str, ggml_type) -> None:
    """convert_hf_to_gguf's --fuse-qkv stores q, k and v as one attn_qkv for every architecture (llama's
    q and k rows permuted within it), and llama.cpp serves such files: so must vivace."""
    model = tiny(kind)
    path = write_gguf(model.hf, tmp_path / f"{kind}.gguf", ggml_type, fuse_qkv=True)
    assert "blk.0.attn_qkv.weight" in GGUFFile(path).tensors and "blk.0.attn_qkv.bias" in GGUFFile(path).tensors
    unfused = write_gguf(model.hf, tmp_path / f"{kind}-unfused.gguf", ggml_type)
    quantization = "none" if ggml_type == F32 else "gguf"  # Q8_0: the quantized layers read the file's rows
    ids = prompt(21, seed=6)
    reference = load_model(str(unfused), torch.float32, quantization)
    expected = PagedRun(reference.model, reference.config).step({"s": ids})["s"]
    loaded = load_model(str(path), torch.float32, quantization)
    assert_close(PagedRun(loaded.model, loaded.config).step({"s": ids})["s"], expected)
    if ggml_type == F32:
        assert_close(expected, hf_logits(model.hf, ids))


def test_q1_0_gguf_loads_as_llama_cpp_dequantizes(tmp_path) -> None:
    """llama-quantize's Q1_0 (a float16 d per 128 weights, each weight +d or -d by its bit), which the
    gguf package sizes but cannot dequantize: llama.cpp serves such files, vivace rejected them."""
    block = np.zeros((1, 18), np.uint8)
    block[0, :2] = np.array([0.5], np.float16).view(np.uint8)
    block[0, 2], block[0, 17] = 0b101, 0b10000000  # weights 0, 2 and 127 positive
    expected = np.full(128, -0.5, np.float32)
    expected[[0, 2, 127]] = 0.5
    np.testing.assert_array_equal(dequantize_blocks(block, Q1_0), expected[None])
    model = tiny_model("llama", hidden_size=128, intermediate_size=256)
    path = write_gguf(model, tmp_path / "q1_0.gguf", types={"attn_q": Q1_0, "ffn_down": Q1_0})
    stored = GGUFFile(path).tensors["blk.0.ffn_down.weight"]
    assert stored.ggml_type == Q1_0
    weight = model.state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
    means = np.abs(weight.reshape(128, 2, 128)).mean(axis=-1, keepdims=True).astype(np.float16).astype(np.float32)
    dequantized = (np.where(weight.reshape(128, 2, 128) >= 0, 1.0, -1.0) * means).reshape(128, 256)
    floats = load_model(str(path), torch.float32, "none")
    assert torch.equal(floats.model.layers[0].mlp.down_proj.weight, torch.from_numpy(dequantized))
    ids = prompt(21, seed=6)
    expected_logits = PagedRun(floats.model, floats.config).step({"s": ids})["s"]
    native = load_model(str(path), torch.float32, "gguf")  # run as Q8_0: +-d as codes +-127, d/127 in float16
    torch.testing.assert_close(native.model.layers[0].mlp.down_proj.dequantize(torch.float32),
                               floats.model.layers[0].mlp.down_proj.weight, rtol=1e-3, atol=0)
    logits = PagedRun(native.model, native.config).step({"s": ids})["s"]
    assert (logits.argmax(-1) == expected_logits.argmax(-1)).float().mean() > 0.9


def test_fill_in_the_middle_separators_end_generation_as_in_llama_cpp(tiny, tmp_path) -> None:
    """llama.cpp also ends generation at a vocabulary's fill-in-the-middle pad, repository and file
    separators, found by text (the default model's <reponame>, a control token) or named by
    ``tokenizer.ggml.fim_*_token_id``: a served model must stop where llama.cpp stops on the same file."""
    default = open_gguf(default_model_path())
    assert default.tokenizer.convert_tokens_to_ids("<reponame>") in default.config.eos_token_ids
    separator = TOKENS.index("he")
    path = write_gguf(tiny("llama").hf, tmp_path / "fim.gguf", token_ids={"tokenizer.ggml.fim_sep_token_id": separator})
    assert load_model(str(path), torch.float32).config.eos_token_ids == (EOS_ID, TOKENS.index("<|endoftext|>"),
                                                                         separator)


def test_named_chat_templates_of_a_gguf_are_the_tokenizers(tiny, tmp_path) -> None:
    """llama.cpp's converter keeps tokenizer_config.json's named templates (Hermes-2-Pro's and
    Command-R's "tool_use") as ``tokenizer.chat_template.<name>``: transformers picks that one for a
    request with tools, as llama.cpp's server does."""
    tool_use = "{% for t in tools %}{{ t.name }}{% endfor %}" + CHAT_TEMPLATE
    path = write_gguf(tiny("llama").hf, tmp_path / "named.gguf",
                      chat_template=[{"name": "default", "template": CHAT_TEMPLATE}, {"name": "tool_use", "template": tool_use}])
    assert load_model(str(path), torch.float32).tokenizer.chat_template == {"default": CHAT_TEMPLATE, "tool_use": tool_use}


def test_gguf_file_keeps_string_arrays_as_lengths(tiny, tmp_path) -> None:
    file = GGUFFile(write_gguf(tiny("qwen2").hf, tmp_path / "m.gguf", F16))
    assert file.metadata["general.architecture"] == "qwen2"
    assert file.metadata["tokenizer.ggml.tokens"] == len(TOKENS)
    assert file.metadata["tokenizer.ggml.token_type"][-1] == gguf.TokenType.CONTROL
    embedding = file.tensors["token_embd.weight"]
    assert embedding.shape == (len(TOKENS), 64) and embedding.ggml_type == F16
    assert file.dequantize(embedding).dtype == "float32"


def test_unsupported_gguf_architecture(tmp_path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'phi2'.*llama, qwen2, qwen3, phi3, gemma3"):
        load_model(str(tmp_path / "phi.gguf"), torch.float32)


def test_gguf_gemma3_config(tiny, tmp_path) -> None:
    loaded = load_model(str(write_gguf(tiny("gemma3").hf, tmp_path / "g.gguf")), torch.float32)
    assert loaded.config == dataclasses.replace(load_model(str(tiny("gemma3").path), torch.float32).config,
                                                max_position_embeddings=loaded.config.max_position_embeddings,
                                                eos_token_ids=loaded.config.eos_token_ids,
                                                rms_norm_eps=loaded.config.rms_norm_eps)  # a float32 there


def test_not_a_gguf_file(tmp_path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all, just text" * 4)
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        load_model(str(tmp_path / "junk.gguf"), torch.float32)


def test_a_truncated_gguf_says_so(tiny, tmp_path) -> None:
    """An incomplete download is refused as such, before the tokenizer or any weight is read."""
    whole = write_gguf(tiny("llama").hf, tmp_path / "whole.gguf").read_bytes()
    for size, where in ((len(whole) - 1, "its tensors take"), (64, "inside its GGUF header")):
        (tmp_path / "cut.gguf").write_bytes(whole[:size])
        with pytest.raises(ValueError, match=f"cut.gguf is truncated: .*{where}"):
            load_model(str(tmp_path / "cut.gguf"), torch.float32)


def test_a_tensor_type_gguf_does_not_know_is_refused_naming_it(tiny, tmp_path) -> None:
    data = bytearray(write_gguf(tiny("llama").hf, tmp_path / "m.gguf").read_bytes())
    name = b"blk.0.attn_q.weight"
    entry = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)  # then n_dims, dims, type
    type_at = entry + 4 + 8 * int.from_bytes(data[entry:entry + 4], "little")
    data[type_at:type_at + 4] = (999).to_bytes(4, "little")
    (tmp_path / "m.gguf").write_bytes(data)
    with pytest.raises(ValueError, match="tensor blk.0.attn_q.weight has ggml type 999, which the gguf package"):
        load_model(str(tmp_path / "m.gguf"), torch.float32)


def test_a_sentencepiece_gguf_tokenizes_as_llama_cpp(tiny, tmp_path) -> None:
    """A SentencePiece GGUF (Llama 2, Mistral 7B, TinyLlama) gets its prefix space as llama.cpp gives it:
    before the text and after every special token, whatever the text starts with. transformers' reading
    left it out before a leading space and after a special token, so chat prompts ("<s>[INST] ...",
    "</s>\n<|assistant|>") were other tokens than llama.cpp's on the same file."""
    path = write_gguf(tiny("llama").hf, tmp_path / "spm.gguf", vocabulary="llama")
    tokenizer = load_model(str(path), torch.float32).tokenizer
    ids = {token: SPM_TOKENS.index(token) for token in ("▁", "▁a", "▁b", "a", "</s>")}
    assert tokenizer.encode("a b", add_special_tokens=False) == [ids["▁a"], ids["▁b"]]
    assert tokenizer.encode(" a b", add_special_tokens=False) == [ids["▁"], ids["▁a"], ids["▁b"]]
    assert tokenizer.encode("</s>a</s> b", add_special_tokens=False) == [
        ids["</s>"], ids["▁a"], ids["</s>"], ids["▁"], ids["▁b"]]
    assert tokenizer.decode(tokenizer.encode(" a b", add_special_tokens=False)) == " a b"
    path = write_gguf(tiny("llama").hf, tmp_path / "bare.gguf", vocabulary="llama-no-space-prefix")
    tokenizer = load_model(str(path), torch.float32).tokenizer  # no prefix space at all, as llama.cpp
    assert tokenizer.encode("a b", add_special_tokens=False) == [SPM_TOKENS.index("a"), ids["▁b"]]
    assert tokenizer.decode(tokenizer.encode(" a b", add_special_tokens=False)) == " a b"


def test_a_llama3_pre_tokenizer_takes_a_word_the_vocabulary_holds_whole(tiny, tmp_path) -> None:
    """llama.cpp runs Llama 3's BPE (pre-tokenizer llama-bpe, as Mistral's Tekken) with ignore_merges, as
    its tokenizer.json says: a word in the vocabulary is that one token even where no merges make it."""
    path = write_gguf(tiny("llama").hf, tmp_path / "llama3.gguf", vocabulary="llama-bpe")
    tokenizer = load_model(str(path), torch.float32).tokenizer
    assert tokenizer.encode(" the", add_special_tokens=False) == [TOKENS.index("Ġthe")]
    plain = load_model(str(write_gguf(tiny("llama").hf, tmp_path / "gpt2.gguf")), torch.float32).tokenizer
    assert plain.encode(" the", add_special_tokens=False) == [TOKENS.index("Ġthe")]  # through its merges


@pytest.mark.parametrize("overrides", [dict(final_logit_softcapping=2.0), dict(sliding_window_pattern=2),
                                       dict(sliding_window_pattern=1)], ids=["softcap", "pattern-2", "no-window"])
def test_gemma3_keys_llama_cpp_reads(tmp_path, overrides) -> None:
    """llama.cpp applies a Gemma 3 file's final logit soft-capping, reads its layers' windows from
    attention.sliding_window_pattern, and runs a file without a window (the converter writes none when
    no layer slides) as all global: vivace ignored the first two and refused the third."""
    model = tiny_model("gemma3", **overrides)
    loaded = load_model(str(write_gguf(model, tmp_path / "gemma3.gguf")), torch.float32)
    ids = prompt(21, seed=6)  # past the window of 6
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], hf_logits(model, ids))
