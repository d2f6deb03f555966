"""IBM Granite 3.x (``GraniteForCausalLM``): a Llama with four multipliers (embeddings, residual
branches, attention scale, logits), against transformers on the same weights: its config, logits
and greedy tokens, int8 weights (through the engine and its compiled decode graph too), and
from GGUFs of llama.cpp's ``granite`` arch (float, and Q8_0 run as stored). The tiny model's
multipliers are ``tiny.GRANITE``; the F32/F16 GGUF and the three paged-cache tests of every kind
(test_gguf.py, test_llama.py) take it too."""

from __future__ import annotations

import gguf
import pytest
import torch

from vivace import LLM, SamplingParams
from vivace.layers.linear import QuantizedLinear
from vivace.models import ModelConfig, load_model

from .gguf_export import write_gguf
from .test_llama import assert_close
from .test_quantize import BOUNDS
from .test_rope_variants import hf_greedy, paged_greedy
from .tiny import GRANITE, PagedRun, hf_logits, prompt

NEW = 32
# granite-3.3-2b-instruct's config.json as published (abridged).
GRANITE_3_3_2B = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "hidden_size": 2048,
                  "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 49159, "max_position_embeddings": 131072,
                  "rope_theta": 10000000.0, "rms_norm_eps": 1e-05, "attention_bias": False, "mlp_bias": False,
                  "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
                  "logits_scaling": 8.0, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
# Q8_0 through the native kernel, which quantizes activations to int8: the relative L2 error of a
# position's logits against transformers' float32 (median over positions, as test_moe.py bounds it).
NATIVE_Q8_MEDIAN_ERROR = 0.03


@pytest.fixture(scope="module")
def granite(tiny):
    return tiny("granite")


def test_reads_granite_3_3_2b_config() -> None:
    config = ModelConfig.from_hf(GRANITE_3_3_2B)
    assert config.architecture == "GraniteForCausalLM" and config.tie_word_embeddings
    assert {name: getattr(config, name) for name in MULTIPLIERS} == {name: GRANITE_3_3_2B[name] for name in MULTIPLIERS}
    assert config.attention_scale == 0.015625 and config.residual_norm_eps == pytest.approx(1e-5 / 0.22 ** 2)
    plain = ModelConfig.from_hf({**GRANITE_3_3_2B, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert plain.attention_scale == 64 ** -0.5 and plain.residual_norm_eps == 1e-5
    with pytest.raises(ValueError, match="unsupported multipliers"):
        ModelConfig.from_hf({**GRANITE_3_3_2B, "residual_multiplier": 0.0})


def test_logits_and_greedy_tokens_match_transformers(granite) -> None:
    loaded = load_model(str(granite.path), torch.float32)
    assert loaded.model.lm_head is None  # tied: the embedding table is not scaled by logits_scaling
    torch.testing.assert_close(loaded.model.embed_tokens.weight, granite.hf.model.embed_tokens.weight, rtol=0, atol=0)
    ids = prompt(30, seed=1)
    logits, tokens = paged_greedy(PagedRun(loaded.model, loaded.config), ids, NEW)
    assert_close(logits, hf_logits(granite.hf, ids))
    assert tokens == hf_greedy(granite.hf, ids, NEW)


def test_int8_logits_and_compiled_decode(granite) -> None:
    """int8 weights keep the logits within test_quantize.py's bound of transformers' float32 ones;
    through the engine, the compiled (AOTInductor) decode graph over them gives the eager int8
    engine's greedy tokens (chunked prefill, two sequences at once)."""
    path = str(granite.path)
    quantized = load_model(path, torch.float32, "int8")
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.model.modules())
    ids = prompt(19, seed=8)
    actual = PagedRun(quantized.model, quantized.config).step({"a": ids})["a"]
    expected = hf_logits(granite.hf, ids)
    assert ((actual - expected).norm() / expected.norm()).item() < BOUNDS["int8"]
    prompts = [prompt(length, seed=2 + length) for length in (37, 9)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    options = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, quantization="int8")
    eager, compiled = LLM(path, **options), LLM(path, **options, compile=True, max_num_seqs=4)
    assert compiled.engine.runner.decoder.backend == "aot"
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, params)] == want
    for engine in (eager, compiled):
        engine.check_integrity()


def test_gguf_of_the_granite_arch(granite, tmp_path) -> None:
    path = write_gguf(granite.hf, tmp_path / "granite.gguf", gguf.GGMLQuantizationType.F16)
    loaded = load_model(str(path), torch.float32)
    assert loaded.config.architecture == "GraniteForCausalLM" and loaded.config.tie_word_embeddings
    # llama.cpp's keys are float32: 0.22 comes back as its nearest float32
    assert {name: getattr(loaded.config, name) for name in MULTIPLIERS} == pytest.approx(
        {name: GRANITE[name] for name in MULTIPLIERS}, rel=1e-7)
    ids = prompt(30, seed=3)
    logits, tokens = paged_greedy(PagedRun(loaded.model, loaded.config), ids, NEW)
    assert_close(logits, hf_logits(granite.hf, ids))
    assert tokens == hf_greedy(granite.hf, ids, NEW)


def test_q8_0_gguf_runs_as_stored(granite, tmp_path) -> None:
    """The multipliers live outside the projections, so Q8_0 blocks run code for code."""
    path = write_gguf(granite.hf, tmp_path / "granite-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    loaded = load_model(str(path), torch.float32, "gguf")
    layer = loaded.model.layers[0]
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert all(isinstance(m, QuantizedLinear) and m.bits == 8 for m in projections)
    ids = prompt(24, seed=4)
    actual = PagedRun(loaded.model, loaded.config).step({"a": ids})["a"]
    expected = hf_logits(granite.hf, ids)
    errors = (actual - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert errors.median().item() < NATIVE_Q8_MEDIAN_ERROR
