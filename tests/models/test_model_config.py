"""ModelConfig.from_hf: what it reads from transformers configs and what it refuses."""

from __future__ import annotations

import pytest
import transformers

from vivace.models import SUPPORTED_ARCHITECTURES, ModelConfig

from .tiny import LLAMA3_ROPE, tiny_config


def test_reads_a_llama_config() -> None:
    config = ModelConfig.from_hf(tiny_config("llama3_rope", eos_token_id=[5, 6]))
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.rope_scaling == LLAMA3_ROPE and config.rope_theta == 10000.0
    assert config.eos_token_ids == (5, 6)
    assert not config.attention_bias and not config.tie_word_embeddings


def test_dict_and_object_agree() -> None:
    for kind in ("qwen2", "mistral", "linear_rope"):
        hf = tiny_config(kind)
        assert ModelConfig.from_hf(hf.to_dict()) == ModelConfig.from_hf(hf)


def test_old_style_rope_keys_in_config_json() -> None:
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
           "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    config = ModelConfig.from_hf(raw)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.num_key_value_heads == 4 and config.head_dim == 16


def test_qwen2_has_qkv_bias_only() -> None:
    config = ModelConfig.from_hf(tiny_config("qwen2"))
    assert config.attention_bias and not config.attention_out_bias


def test_llama_attention_bias_covers_the_output_projection() -> None:
    config = ModelConfig.from_hf(tiny_config("llama_bias"))
    assert config.attention_bias and config.attention_out_bias


def test_unsupported_architecture() -> None:
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'") as error:
        ModelConfig.from_hf(transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_sliding_windows() -> None:
    config = ModelConfig.from_hf(tiny_config("mistral", sliding_window=16))
    assert config.sliding_window == 16 and [config.window(i) for i in range(2)] == [16, 16]
    # A window as long as the context is full attention.
    assert ModelConfig.from_hf(tiny_config("mistral", sliding_window=128)).sliding_window is None
    assert ModelConfig.from_hf(tiny_config("qwen2", sliding_window=16, use_sliding_window=False)).window(1) is None
    qwen = ModelConfig.from_hf(tiny_config("qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1))
    assert [qwen.window(i) for i in range(2)] == [None, 16]


def test_reads_gemma3() -> None:
    config = ModelConfig.from_hf(tiny_config("gemma3"))
    assert config.architecture == "Gemma3ForCausalLM" and config.qk_norm
    assert [config.window(i) for i in range(7)] == [6] * 5 + [None, 6]
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.head_dim == 32 and config.hidden_size == 32
    scaled = ModelConfig.from_hf(tiny_config("gemma3", query_pre_attn_scalar=24, sliding_window_pattern=2))
    assert scaled.attention_scale == 24 ** -0.5 and scaled.layer_types[:2] == ("sliding_attention", "full_attention")
    assert ModelConfig.from_hf(tiny_config("gemma3").to_dict()) == config


def test_reads_qwen3_and_phi3() -> None:
    qwen3 = ModelConfig.from_hf(tiny_config("qwen3"))
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32 and qwen3.sliding_window is None
    phi3 = ModelConfig.from_hf(tiny_config("phi3"))
    assert phi3.architecture == "Phi3ForCausalLM" and phi3.sliding_window == 9 and not phi3.qk_norm


def test_unsupported_gemma_and_phi_features() -> None:
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf(tiny_config("gemma3", attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="partial rotary"):
        ModelConfig.from_hf(tiny_config("llama", partial_rotary_factor=0.5))  # Phi-3 only
    with pytest.raises(ValueError, match="'gelu' for Gemma3ForCausalLM"):
        ModelConfig.from_hf(tiny_config("gemma3", hidden_activation="gelu"))


def test_dynamic_rope_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="dynamic.*batch composition"):
        ModelConfig.from_hf(tiny_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_rope_scaling_without_its_parameters_is_a_value_error() -> None:
    """transformers raises KeyError for them; the command line reports a ValueError and exits 2."""
    with pytest.raises(ValueError, match="invalid config: .*'llama3'.*high_freq_factor"):
        ModelConfig.from_hf(tiny_config("llama").to_dict() | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_other_unsupported_features() -> None:
    with pytest.raises(ValueError, match="activation 'gelu'"):
        ModelConfig.from_hf(tiny_config("llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf(tiny_config("llama", mlp_bias=True))
