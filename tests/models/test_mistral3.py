"""Mistral 3's multimodal checkpoints (``Mistral3ForConditionalGeneration``: Mistral-Small-3.1/3.2,
Ministral 3) served for their text, and the Ministral text models (``MinistralForCausalLM``'s
per-layer windows, ``Ministral3ForCausalLM``'s query temperature by position), against
transformers: configs, logits and greedy tokens, the LM head as transformers 5 ties it, and the
engine with batched prompts, chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from vivace import LLM, SamplingParams
from vivace.models import ModelConfig, load_model
from vivace.models.config import FULL, SLIDING

from .test_llama import assert_close
from .test_rope_variants import hf_greedy, paged_greedy
from .tiny import _COMMON, PagedRun, hf_logits, prompt, random_model, save_hf_dir

# Ministral 3's rope at tiny size: YaRN past 16 positions, and queries scaled by
# 1 + 0.5 * log(1 + floor(p / 16)): prompts of 40 tokens cross two periods.
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.5}
TEXT = {
    # Mistral-Small-3.1/3.2: a Mistral with head_dim apart from hidden/heads, no window, untied.
    "mistral_small": (transformers.MistralConfig, dict(head_dim=32, sliding_window=None)),
    # Ministral 3 (3B ties its embeddings).
    "ministral3": (transformers.Ministral3Config, dict(head_dim=16, max_position_embeddings=64, pad_token_id=None,
                                                        rope_parameters=MINISTRAL3_ROPE, tie_word_embeddings=True)),
    # Ministral-8B's interleaved attention: layer 0 windowed, layer 1 global.
    "ministral": (transformers.MinistralConfig, dict(head_dim=16, sliding_window=5, layer_types=[SLIDING, FULL])),
}
# Mistral-Small-3.1-24B-Instruct-2503's config.json as published (abridged).
MISTRAL_SMALL_31 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "image_token_index": 10,
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                    "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
                    "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                    "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
    "vision_config": {"head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
                      "intermediate_size": 4096, "model_type": "pixtral", "num_attention_heads": 16,
                      "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0},
    "vision_feature_layer": -1,
}
WRAPPED = ("mistral_small", "ministral3")
NEW = 16


def text_config(kind: str) -> transformers.PretrainedConfig:
    config_class, extra = TEXT[kind]
    return config_class(**{**_COMMON, **extra})


def wrapper_config(kind: str) -> transformers.Mistral3Config:
    """``TEXT[kind]`` under Mistral 3's wrapper, with a one-layer Pixtral tower."""
    text = text_config(kind)
    vision = transformers.PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, head_dim=8, image_size=16, patch_size=4)
    return transformers.Mistral3Config(text_config=text, vision_config=vision,
                                       tie_word_embeddings=text.tie_word_embeddings)


def forget_tying(path: Path) -> None:
    """Drop ``tie_word_embeddings`` from config.json, as Mistral-Small's is published: transformers 5's
    Mistral3Config then defaults to tied, though the checkpoint has an LM head of its own."""
    file = path / "config.json"
    config = json.loads(file.read_text())
    for part in (config, config["text_config"]):
        part.pop("tie_word_embeddings", None)
    file.write_text(json.dumps(config))


def save_wrapped(kind: str, out: Path) -> tuple[transformers.PreTrainedModel, Path]:
    """The random wrapped model of ``TEXT[kind]``, saved in ``out`` (Mistral-Small's config.json
    without its tying key)."""
    hf = random_model(wrapper_config(kind), auto_class=transformers.AutoModelForImageTextToText)
    save_hf_dir(hf, out)
    if kind == "mistral_small":
        forget_tying(out)
    return hf, out


@pytest.fixture(scope="module", params=WRAPPED)
def wrapped(request, tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    return save_wrapped(request.param, tmp_path_factory.mktemp(request.param))


def test_reads_the_text_config_of_mistral_small_and_ministral_3() -> None:
    config = ModelConfig.from_hf(MISTRAL_SMALL_31)
    assert config.architecture == "MistralForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim, config.vocab_size) == (40, 5120, 128, 131072)
    assert (config.rope_theta, config.sliding_window, config.max_position_embeddings) == (1e9, None, 131072)
    ministral3 = ModelConfig.from_hf(transformers.Mistral3Config(text_config=transformers.Ministral3Config()))
    assert ministral3.architecture == "Ministral3ForCausalLM" and ministral3.query_temperature == (0.1, 16384)
    assert ministral3.rope_scaling["factor"] == 16.0 and ministral3.rope_scaling["attention_factor"] == 1.0
    assert ModelConfig.from_hf(transformers.Ministral3Config(rope_parameters={
        **MINISTRAL3_ROPE, "llama_4_scaling_beta": 0.0})).query_temperature is None


def test_wrapped_logits_and_greedy_tokens_match_transformers(wrapped) -> None:
    hf, path = wrapped
    loaded = load_model(str(path), torch.float32)
    # Mistral-Small's config (no tying key) says tied; its checkpoint's own LM head wins, as in transformers 5.
    assert (loaded.model.lm_head is None) == hf.config.tie_word_embeddings
    ids = prompt(40, seed=1)
    logits, tokens = paged_greedy(PagedRun(loaded.model, loaded.config), ids)
    assert_close(logits, hf_logits(hf, ids))
    assert tokens == hf_greedy(hf, ids)


def test_transformers_unties_the_published_mistral_small_config_too(tmp_path) -> None:
    """The premise of the LM head above: transformers 5, given that directory, keeps the head."""
    hf, path = save_wrapped("mistral_small", tmp_path)
    reloaded = transformers.Mistral3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    assert reloaded.config.tie_word_embeddings
    ids = prompt(12, seed=2)
    assert_close(hf_logits(reloaded, ids), hf_logits(hf, ids))


@pytest.mark.parametrize("kind", ["ministral", "ministral3"])
def test_ministral_text_models_match_transformers(tmp_path, kind: str) -> None:
    hf = random_model(text_config(kind))
    loaded = load_model(str(save_hf_dir(hf, tmp_path)), torch.float32)
    assert loaded.config.architecture == type(hf).__name__
    ids = prompt(40, seed=3)
    logits, tokens = paged_greedy(PagedRun(loaded.model, loaded.config), ids)
    assert_close(logits, hf_logits(hf, ids))
    assert tokens == hf_greedy(hf, ids)
    if kind == "ministral":
        assert [loaded.model.layers[i].self_attn.window for i in (0, 1)] == [5, None]
    else:  # guards the query temperature: without it, the positions past 16 have other logits
        for layer in loaded.model.layers:
            layer.self_attn.scales_queries = False
        plain = PagedRun(loaded.model, loaded.config).step({"a": ids})["a"]
        assert_close(plain[:16], logits[:16])
        assert (plain[16:] - logits[16:]).abs().max() > 1e-2


def test_engine_batched_chunked_and_prefix_cached(wrapped) -> None:
    hf, path = wrapped
    prompts = [prompt(length, seed=4 + length) for length in (37, 9)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    llm = LLM(str(path), num_kv_blocks=48, block_size=4, max_num_batched_tokens=8, max_model_len=64)
    want = [hf_greedy(hf, ids) for ids in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    again = llm.generate(prompts[0], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want[0]
    llm.check_integrity()
