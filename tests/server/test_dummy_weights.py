"""``--load-format dummy``: random weights at the shape of a config.json or a preset, with the
default model's tokenizer, served end to end on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine
from vivace.models.config import ModelConfig
from vivace.models.dummy import PRESETS
from vivace.models.loader import load_model
from vivace.server import ServerSettings

from .harness import assert_engine_idle, serving

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=64,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_is_a_supported_config(preset: str) -> None:
    config = ModelConfig.from_hf(PRESETS[preset])
    assert config.num_hidden_layers > 0 and config.sliding_window is None


def test_dummy_weights_from_a_config_json_serve_with_the_default_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    loaded = load_model(str(tmp_path / "config.json"), __import__("torch").float32, load_format="dummy")
    assert loaded.model.lm_head.weight.shape == (49152, 64)
    assert float(loaded.model.layers[0].input_layernorm.weight.min()) == 1.0
    assert float(loaded.model.layers[0].mlp.down_proj.weight.std()) == pytest.approx(0.02, rel=0.2)
    assert loaded.tokenizer.chat_template  # the default model's, template included
    engine = AsyncEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu",
                                      num_kv_blocks=32, max_num_seqs=4))
    try:
        with serving(engine, ServerSettings(served_model_name="dummy")) as server:
            client = server.client()
            chat = client.chat.completions.create(model="dummy", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=8, temperature=0)
            assert chat.usage.completion_tokens == 8 or chat.choices[0].finish_reason == "stop"
            again = client.chat.completions.create(model="dummy", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=8, temperature=0)
            assert again.choices[0].message.content == chat.choices[0].message.content
            stream = client.completions.create(model="dummy", prompt="Once upon", max_tokens=5, stream=True)
            assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text is not None) >= 1
        assert_engine_idle(engine)
    finally:
        engine.shutdown()


def test_a_missing_dummy_shape_names_the_presets() -> None:
    with pytest.raises(FileNotFoundError, match="llama-3.1-8b"):
        load_model("no-such-model", __import__("torch").float32, load_format="dummy")



def test_dummy_weights_take_the_quantization_asked_for(tiny_model_dir: Path) -> None:
    """``--load-format dummy --quantization int4`` measures a quantized model of that shape, not a
    float one: every decoder projection quantized, the logits layer too (int8, as from real weights)."""
    from vivace.layers.linear import QuantizedLinear

    for quantization in ("int8", "int4"):
        loaded = load_model(str(tiny_model_dir), __import__("torch").float32, quantization, load_format="dummy")
        layer = loaded.model.layers[0]
        projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        assert all(isinstance(p, QuantizedLinear) and p.bits == int(quantization[3:]) for p in projections)
        assert isinstance(loaded.model.lm_head, QuantizedLinear) and loaded.model.lm_head.bits == 8
