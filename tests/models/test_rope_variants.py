"""LongRoPE (Phi-3.5-mini, Phi-4-mini), YaRN (long-context Qwen and Llama configs) and partial rotary
(Phi-4-mini) against transformers: rotation speeds and tables, logits and greedy tokens in both
LongRoPE regimes (the served context picks the factors), through the engine, and from GGUF files."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from vivace import LLM, SamplingParams
from vivace.layers.rotary import apply_rotary, inverse_frequencies, rotary_tables
from vivace.layers.linear import QuantizedLinear
from vivace.models import ModelConfig, load_model
from vivace.models.gguf import model_config
from vivace.models.gguf_file import GGUFFile
from vivace.models.partial_rotary import head_order, row_order

from .gguf_export import write_gguf
from .test_llama import assert_close
from .tiny import PHI3_LONGROPE, PagedRun, hf_logits, prompt, save_hf_dir, tiny_config, tiny_model

QWEN3_YARN = dict(rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32})
# Served context -> prompt length: at most the original 32 positions rotate with the short factors
# (transformers too, for a sequence that stays within them); beyond, every position with the long
# ones (transformers too, for a prompt already past them).
REGIMES = {"short": (32, 12), "long": (None, 40)}
NEW = 16


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    hf = tiny_model("phi3", **PHI3_LONGROPE)
    return hf, save_hf_dir(hf, tmp_path_factory.mktemp("phi3_longrope"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    hf = tiny_model("qwen3", **QWEN3_YARN)
    return hf, save_hf_dir(hf, tmp_path_factory.mktemp("qwen3_yarn"))


def hf_greedy(hf: transformers.PreTrainedModel, ids: list[int], new: int = NEW) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def paged_greedy(run: PagedRun, ids: list[int], new: int = NEW) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits and ``new`` greedy tokens, one decode step each."""
    logits = run.step({"a": ids})["a"]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < new:
        tokens.append(int(run.step({"a": tokens[-1:]})["a"][-1].argmax()))
    return logits, tokens


# --- rotation speeds and tables ------------------------------------------------------------------

def phi35_config(**overrides: object) -> transformers.Phi3Config:
    """Phi-3.5-mini's rope: 48 factors, original context 4096 of 131072 (factors made up)."""
    factors = torch.linspace(1.0, 30.0, 48, dtype=torch.float64)
    rope = {"rope_type": "longrope", "short_factor": (factors ** 0.3).tolist(), "long_factor": factors.tolist()}
    return transformers.Phi3Config(**{**dict(hidden_size=3072, num_attention_heads=32, num_hidden_layers=1,
                                             max_position_embeddings=131072, original_max_position_embeddings=4096,
                                             rope_scaling=rope), **overrides})


@pytest.mark.parametrize("served, long", [(4096, False), (131072, True), (8192, True)])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_frequencies_match_transformers(served: int, long: bool, partial: float) -> None:
    # Phi-4-mini: 24 heads of 128 dims, 96 of them rotating; Phi-3.5-mini: 32 heads of 96.
    hf_config = phi35_config(partial_rotary_factor=partial, num_attention_heads=24 if partial != 1.0 else 32)
    config = ModelConfig.from_hf(hf_config)
    rotary_dim = config.rotary_dim or config.head_dim
    want, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=served if long else None)
    ours = inverse_frequencies(rotary_dim, config.rope_theta, config.rope_scaling, served)
    assert torch.equal(ours, want)
    assert config.rope_scaling["attention_factor"] == attention_factor == math.sqrt(1 + math.log(32) / math.log(4096))


YARN_CASES = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                                             rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 32768})),
    "llama_betas_untruncated": (transformers.LlamaConfig, dict(
        hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, max_position_embeddings=65536,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                      "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False})),
    "mscale": (transformers.LlamaConfig, dict(
        hidden_size=2048, num_attention_heads=16, max_position_embeddings=16384,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                      "mscale": 1.0, "mscale_all_dim": 0.5})),
    "attention_factor": (transformers.Qwen2Config, dict(
        hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                      "attention_factor": 1.5})),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_frequencies_match_transformers(case: str) -> None:
    config_class, kwargs = YARN_CASES[case]
    hf_config = config_class(**kwargs)
    config = ModelConfig.from_hf(hf_config)
    want, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, None)
    assert torch.equal(inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling), want)
    assert config.rope_scaling["attention_factor"] == attention_factor
    scaling = hf_config.rope_parameters
    assert config.max_position_embeddings == max(hf_config.max_position_embeddings,
                                                 scaling["factor"] * scaling["original_max_position_embeddings"])


def test_reads_phi4_mini_config_json() -> None:
    raw = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
           "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
           "vocab_size": 200064, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
           "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "sliding_window": 262144,
           "rope_scaling": {"long_factor": [2.0] * 48, "short_factor": [1.0] * 48, "type": "longrope"}}
    config = ModelConfig.from_hf(raw)
    assert (config.head_dim, config.rotary_dim, config.sliding_window) == (128, 96, None)
    assert config.rope_scaling == {"rope_type": "longrope", "short_factor": (1.0,) * 48, "long_factor": (2.0,) * 48,
                                   "original_max_position_embeddings": 4096,
                                   "attention_factor": math.sqrt(1 + math.log(32) / math.log(4096))}
    hf = tiny_config("phi3", **PHI3_LONGROPE)
    assert ModelConfig.from_hf(hf.to_dict()) == ModelConfig.from_hf(hf)


def test_longropes_first_name_su_reads_as_longrope() -> None:
    """Phi-3-mini-128k's and Phi-3-medium-128k's first config.json name it "su" (vLLM reads both)."""
    raw = tiny_config("phi3", **PHI3_LONGROPE).to_dict()
    raw.pop("rope_parameters", None)
    longrope = {**raw, "rope_scaling": PHI3_LONGROPE["rope_scaling"]}
    su = {**raw, "rope_scaling": {**PHI3_LONGROPE["rope_scaling"], "rope_type": "su"}}
    assert ModelConfig.from_hf(su) == ModelConfig.from_hf(longrope)
    assert ModelConfig.from_hf(su).rope_scaling["rope_type"] == "longrope"


def test_yarn_serves_factor_times_the_original_context() -> None:
    """Qwen's long-context recipe keeps max_position_embeddings at the original context."""
    config = ModelConfig.from_hf(tiny_config("qwen3", max_position_embeddings=32, **QWEN3_YARN))
    assert config.max_position_embeddings == 128
    assert config.served_with(64).max_position_embeddings == 64
    assert config.served_with(128) is config
    with pytest.raises(ValueError, match="--max-model-len 129 is more than the model's context length .128"):
        config.served_with(129)


@pytest.mark.parametrize("positions", [32, 128])
def test_partial_rotary_tables_match_transformers(positions: int) -> None:
    """Rotating columns: transformers' cos and sin (times the attention factor) for its first 12
    dims; the other columns leave the pass-through dims as they are."""
    hf_config = tiny_config("phi3", **PHI3_LONGROPE)
    config = ModelConfig.from_hf(hf_config)
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_config)
    hf_cos, hf_sin = rotary(torch.zeros(1), torch.arange(positions)[None])
    cos, sin = rotary_tables(16, positions, config.rope_theta, config.rope_scaling, config.rotary_dim)
    assert config.rotary_dim == 12 and hf_cos.shape[-1] == 12
    assert torch.equal(cos[:, :6], hf_cos[0, :, :6]) and torch.equal(sin[:, :6], hf_sin[0, :, :6])
    assert torch.equal(cos[:, 6:], torch.ones(positions, 2)) and torch.equal(sin[:, 6:], torch.zeros(positions, 2))


def test_reordered_heads_rotate_as_transformers_partial_rotary() -> None:
    """HF's rotation of the first r dims of a head, pass-through after them, equals vivace's
    full-head rotation of the reordered head, for any q and k."""
    head_dim, rotary_dim, n = 16, 12, 9
    order = head_order(head_dim, rotary_dim)
    assert sorted(order.tolist()) == list(range(head_dim))
    hf_config = tiny_config("phi3", **PHI3_LONGROPE)
    config = ModelConfig.from_hf(hf_config)
    hf_cos, hf_sin = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_config)(
        torch.zeros(1), torch.arange(n)[None])
    q = torch.randn(1, 3, n, head_dim, generator=torch.Generator().manual_seed(0))
    want, _ = transformers.models.phi3.modeling_phi3.apply_rotary_pos_emb(q, q, hf_cos, hf_sin)
    cos, sin = rotary_tables(head_dim, n, config.rope_theta, config.rope_scaling, rotary_dim)
    ours = apply_rotary(q[0].transpose(0, 1)[..., order], cos[:, None], sin[:, None])
    torch.testing.assert_close(ours, want[0].transpose(0, 1)[..., order], rtol=0, atol=1e-6)


def test_row_order_of_fused_qkv() -> None:
    config = ModelConfig.from_hf(tiny_config("phi3", **PHI3_LONGROPE))  # 4 q heads, 2 kv heads of 16
    order = row_order("model.layers.0.self_attn.qkv_proj.weight", config)
    head = head_order(16, 12)
    assert order.tolist() == [*np.concatenate([16 * h + head for h in range(6)]).tolist(), *range(96, 128)]
    assert row_order("model.layers.0.self_attn.k_proj.bias", config).tolist() == [*head, *(16 + head)]
    assert row_order("model.layers.0.self_attn.o_proj.weight", config) is None
    assert row_order("model.layers.0.self_attn.qkv_proj.weight", ModelConfig.from_hf(tiny_config("phi3"))) is None


def test_partial_rotary_outside_phi3_is_refused() -> None:
    with pytest.raises(ValueError, match="partial rotary.*Phi3ForCausalLM only"):
        ModelConfig.from_hf(tiny_config("llama", partial_rotary_factor=0.5))


# --- models against transformers -------------------------------------------------------------------

@pytest.mark.parametrize("regime", REGIMES)
def test_phi3_longrope_partial_rotary_matches_transformers(phi3, regime: str) -> None:
    hf, path = phi3
    served, length = REGIMES[regime]
    loaded = load_model(str(path), torch.float32, max_model_len=served)
    assert loaded.model.rotary.cos.shape == (served or 128, 8)
    ids = prompt(length, seed=11)
    logits, tokens = paged_greedy(PagedRun(loaded.model, loaded.config, num_blocks=32), ids)
    assert_close(logits, hf_logits(hf, ids))
    assert tokens == hf_greedy(hf, ids)


def test_the_regimes_differ(phi3) -> None:
    """Guards the test above: served one position past the original context, the long factors
    give other logits from the first position."""
    _, path = phi3
    ids = prompt(12, seed=11)
    logits = []
    for served in (32, 33):
        loaded = load_model(str(path), torch.float32, max_model_len=served)
        logits.append(PagedRun(loaded.model, loaded.config, num_blocks=8).step({"a": ids})["a"])
    assert (logits[0] - logits[1]).abs().max() > 1e-2


def test_qwen3_yarn_matches_transformers(qwen3) -> None:
    hf, path = qwen3
    loaded = load_model(str(path), torch.float32)
    assert loaded.config.rope_scaling["rope_type"] == "yarn"
    ids = prompt(40, seed=12)
    logits, tokens = paged_greedy(PagedRun(loaded.model, loaded.config, num_blocks=32), ids)
    assert_close(logits, hf_logits(hf, ids))
    assert tokens == hf_greedy(hf, ids)


@pytest.mark.parametrize("regime", REGIMES)
def test_engine_greedy_with_chunked_prefill_and_prefix_cache(phi3, regime: str) -> None:
    hf, path = phi3
    served, length = REGIMES[regime]
    ids = prompt(length, seed=13)
    new = min(NEW, (served or 128) - length - 1)
    llm = LLM(str(path), max_model_len=served, num_kv_blocks=40, block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    want = hf_greedy(hf, ids, new)
    assert llm.generate(ids, params)[0].outputs[0].token_ids == want
    again = llm.generate(ids, params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want
    llm.engine.check_integrity()


# --- GGUF ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("regime", REGIMES)
def test_phi3_gguf_with_rope_factor_tensors(phi3, tmp_path, regime: str) -> None:
    hf, path = phi3
    served, length = REGIMES[regime]
    gguf_path = write_gguf(hf, tmp_path / "phi3.gguf", gguf.GGMLQuantizationType.F32)
    loaded = load_model(str(gguf_path), torch.float32, max_model_len=served)
    reference = load_model(str(path), torch.float32, max_model_len=served)
    scaling, want = loaded.config.rope_scaling, reference.config.rope_scaling
    assert loaded.config.rotary_dim == 12
    assert {**scaling, "attention_factor": 0} == {**want, "attention_factor": 0}
    assert scaling["attention_factor"] == pytest.approx(want["attention_factor"], rel=1e-7)  # float32 there
    ids = prompt(length, seed=14)
    expected = PagedRun(reference.model, reference.config).step({"a": ids})["a"]
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], expected)


def test_phi3_gguf_blocks_taken_as_stored_are_reordered(phi3, tmp_path) -> None:
    """Q8_0 projections run code for code ("gguf" mode) hold the rows the float model holds."""
    hf, _ = phi3
    gguf_path = write_gguf(hf, tmp_path / "phi3-q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    reference = load_model(str(gguf_path), torch.float32, "none").model
    quantized = load_model(str(gguf_path), torch.float32, "gguf").model
    qkv = quantized.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    torch.testing.assert_close(qkv.dequantize(), reference.layers[0].self_attn.qkv_proj.weight, rtol=0, atol=1e-6)


def test_qwen3_yarn_gguf(qwen3, tmp_path) -> None:
    hf, path = qwen3
    loaded = load_model(str(write_gguf(hf, tmp_path / "qwen3.gguf")), torch.float32)
    reference = load_model(str(path), torch.float32)
    assert loaded.config.rope_scaling == reference.config.rope_scaling
    assert loaded.config.max_position_embeddings == reference.config.max_position_embeddings
    ids = prompt(40, seed=15)
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], hf_logits(hf, ids))


def metadata_only_gguf(path, arch: str, keys: dict[str, object], tensors: dict[str, np.ndarray]) -> GGUFFile:
    """A GGUF with the hyperparameters ``model_config`` needs, ``keys`` (``{arch}`` filled in) and
    ``tensors`` (beside a token embedding)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in keys.items():
        writer.add_key_value(key.format(arch=arch), value, gguf.GGUFValueType.get_type(value))
    for name, values in {"token_embd.weight": np.zeros((8, 64), np.float32), **tensors}.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


def test_gguf_rope_refusals(tmp_path) -> None:
    yarn = {"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
            "{arch}.rope.scaling.original_context_length": 32}
    assert model_config(metadata_only_gguf(tmp_path / "a.gguf", "qwen3", yarn, {})).rope_scaling["factor"] == 4.0
    with pytest.raises(ValueError, match="yarn_attn_factor"):
        model_config(metadata_only_gguf(tmp_path / "b.gguf", "qwen3",
                                        {**yarn, "{arch}.rope.scaling.yarn_attn_factor": 2.0}, {}))
    with pytest.raises(ValueError, match="rope_factors_long.weight"):
        model_config(metadata_only_gguf(tmp_path / "c.gguf", "phi3", {},
                                        {"rope_factors_long.weight": np.ones(8, np.float32)}))
    with pytest.raises(ValueError, match="partial rotary"):
        model_config(metadata_only_gguf(tmp_path / "d.gguf", "llama", {"{arch}.rope.dimension_count": 8}, {}))
    with pytest.raises(ValueError, match="unsupported GGUF rope scaling 'dynamic'"):
        model_config(metadata_only_gguf(tmp_path / "e.gguf", "llama", {"{arch}.rope.scaling.type": "dynamic"}, {}))


def test_linear_scaling_serves_factor_times_the_context_as_vllm(tiny, tmp_path) -> None:
    """vLLM serves a linearly scaled model (vicuna-7b-v1.5-16k: 4096 positions, factor 4) its factor
    times max_position_embeddings, from its directory or a GGUF, and matches transformers there;
    Gemma 3's max_position_embeddings is already the scaled context (vLLM leaves it)."""
    model = tiny("linear_rope")
    served = int(model.hf.config.max_position_embeddings * model.hf.config.rope_parameters["factor"])
    ids = prompt(served - 8, seed=5)
    expected = hf_logits(model.hf, ids)
    for path in (model.path, write_gguf(model.hf, tmp_path / "linear.gguf")):
        loaded = load_model(str(path), torch.float32)
        assert loaded.config.max_position_embeddings == served
        assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], expected)
    gemma3 = tiny("gemma3_linear_rope").hf.config
    assert ModelConfig.from_hf(gemma3).max_position_embeddings == gemma3.max_position_embeddings
