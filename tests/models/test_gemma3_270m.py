"""The real Gemma 3 270M (Q4_K_M GGUF from its chunk packages): the assembled file's hash, greedy
output with float weights against transformers' load of the same file, and the file's own
quantized formats against its dequantized values. Slow: each loads the 262k-vocabulary model."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
import transformers

from vivace.layers.linear import QuantizedLinear, StackedLinear
from vivace.models import LoadedModel, load_model
from vivace.models.bundled import BUNDLED, bundled_model_path

from tests.gguf_reference import without_vocabulary

from .tiny import PagedRun

GEMMA = BUNDLED["gemma-3-270m"]
PROMPT = "The capital of France is Paris, and the capital of Italy is"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def float_gemma() -> LoadedModel:
    return load_model("gemma-3-270m", torch.float32, "none")


def test_assembled_once_into_the_cache_with_its_hash(monkeypatch, tmp_path) -> None:
    path = bundled_model_path(GEMMA)
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 22):
            digest.update(block)
    assert digest.hexdigest() == GEMMA.sha256
    assert bundled_model_path(GEMMA) == path  # found again, not rebuilt
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="assemble to sha256"):
        bundled_model_path(dataclasses.replace(GEMMA, sha256="0" * 64))
    assert list((tmp_path / "vivace" / "models").iterdir()) == []  # nothing half-made is left


def test_greedy_output_equals_transformers_on_the_same_gguf(float_gemma, tmp_path) -> None:
    config = float_gemma.config
    assert float_gemma.name == "gemma-3-270m" and config.architecture == "Gemma3ForCausalLM"
    assert (config.num_hidden_layers, config.head_dim, config.sliding_window) == (18, 256, 512)
    assert float_gemma.tokenizer.chat_template is None  # a base model: chat requests get a 400
    ids = float_gemma.tokenizer.encode(PROMPT)
    run, ours, chunk = PagedRun(float_gemma.model, config, block_size=16), [], ids
    for _ in range(8):
        ours.append(int(run.step({"a": chunk})["a"][-1].argmax()))
        chunk = ours[-1:]
    # transformers reads the file's own tensors and hyperparameters; not its 262k-token vocabulary
    # (~30 s of its GGUF reader's time), which the model does not need.
    path = without_vocabulary(float_gemma.source, tmp_path / float_gemma.source.name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    theirs = reference.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert ours == theirs[0, len(ids):].tolist()


def test_q4_k_m_in_its_own_formats_tracks_the_float_weights(float_gemma) -> None:
    """The file's Q5_0, Q4_K, Q6_K and Q8_0 tensors decoded by vivace (no float copy, each in its
    own format) give the logits of gguf's dequantization, up to (on the native path) the int8
    rounding of activations."""
    ids = float_gemma.tokenizer.encode(PROMPT)
    expected = PagedRun(float_gemma.model, float_gemma.config, block_size=16).step({"a": ids})["a"]
    loaded = load_model("gemma-3-270m", torch.float32, "gguf")  # what auto picks with native kernels
    projections = [p for layer in loaded.model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(isinstance(p, (QuantizedLinear, StackedLinear)) for p in projections) and loaded.model.lm_head.bits == 8
    # The 9 layers whose v is Q8_0 (q and k Q5_0) run q/k and v apart, each in its own format.
    stacked = [p for p in projections if isinstance(p, StackedLinear)]
    assert len(stacked) == 9 and all([part.bits for part in p.parts] == [5, 8] for p in stacked)
    layers = [m for m in loaded.model.layers.modules() if isinstance(m, QuantizedLinear)]
    assert {m.bits for m in layers} == {4, 5, 6, 8}  # Q4_K, Q5_0, Q6_K, Q8_0: 4-, 5-, 6-, 8-bit codes
    actual = PagedRun(loaded.model, loaded.config, block_size=16).step({"a": ids})["a"]
    assert ((actual - expected).norm() / expected.norm()).item() < 0.03
    assert actual[-1].argmax() == expected[-1].argmax()
