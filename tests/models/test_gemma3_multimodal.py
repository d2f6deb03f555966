"""Gemma 3's multimodal checkpoints (gemma-3-4b/12b/27b, ``Gemma3ForConditionalGeneration``)
served for their text: the config's text part as transformers reads it, both tensor-name
conventions, the vision tower and projector left unread, and logits and greedy tokens against
transformers' ``Gemma3ForConditionalGeneration`` on text."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import transformers

from vivace import LLM, SamplingParams
from vivace.models import ModelConfig, load_model
from vivace.models.config import FULL, SLIDING

from .test_llama import assert_close
from .tiny import EOS_ID, TOKENS, PagedRun, hf_logits, prompt, random_model, save_hf_dir, tiny_config

# google/gemma-3-4b-it's config.json as published (transformers 4.50): transformers' defaults
# fill the rest of text_config (vocabulary, heads, head_dim, rope bases, window pattern).
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
# gemma-3-27b-it's text_config differs in these (an attention scale apart from head_dim).
GEMMA3_27B_TEXT = {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32,
                   "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168}
OTHER_EOS = TOKENS.index("<|endoftext|>")
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# transformers 4.52 to 4.57 saved under model.language_model (5 writes the older names back).
NEWER_NAMES = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
               "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}
CHECKPOINTS = ["tied", "tied_newer_names", "untied"]


def multimodal_config(tied: bool = True) -> transformers.Gemma3Config:
    """gemma-3-4b-it in small: the tiny Gemma 3 text model with its rope (5 sliding layers, 1 global
    with linear scaling, 1 sliding), a one-layer SigLIP tower, 4 tokens per image, the wrapper's EOS
    ids apart from the text config's (as gemma-3-4b-it's), and a final logit soft-cap in the text
    config, which transformers' wrapper never applies."""
    text = tiny_config("gemma3_linear_rope", final_logit_softcapping=30.0, tie_word_embeddings=tied)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=16, patch_size=4, vision_use_head=False)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     tie_word_embeddings=tied, eos_token_id=[EOS_ID, OTHER_EOS])


def rename_tensors(path: Path, prefixes: dict[str, str]) -> None:
    """Rewrite ``path``'s model.safetensors with each tensor's leading prefix of ``prefixes`` replaced."""
    file = path / "model.safetensors"
    tensors = safetensors.torch.load_file(file)
    renamed = {}
    for name, tensor in tensors.items():
        prefix = next((p for p in prefixes if name.startswith(p)), "")
        renamed[prefixes.get(prefix, "") + name.removeprefix(prefix)] = tensor
    safetensors.torch.save_file(renamed, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_models() -> dict[bool, transformers.Gemma3ForConditionalGeneration]:
    return {tied: random_model(multimodal_config(tied)) for tied in (True, False)}


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request, hf_models, tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    hf = hf_models[request.param != "untied"]
    path = save_hf_dir(hf, tmp_path_factory.mktemp(request.param))
    if request.param == "tied_newer_names":
        rename_tensors(path, NEWER_NAMES)
    return hf, path


def test_reads_the_text_config_of_gemma_3_4b_it_and_27b() -> None:
    config = ModelConfig.from_hf(GEMMA3_4B_IT)
    assert config.architecture == "Gemma3ForCausalLM" and config.qk_norm and config.tie_word_embeddings
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.head_dim) == (262208, 2560, 34, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.attention_scale) == (8, 4, 256 ** -0.5)
    assert config.layer_types == ((SLIDING,) * 5 + (FULL,)) * 5 + (SLIDING,) * 4 and config.sliding_window == 1024
    # Linear scaling on the global layers only; sliding ones rotate unscaled with their own base.
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (config.rope_theta, config.local_rope_theta, config.max_position_embeddings) == (1e6, 1e4, 131072)
    assert config.eos_token_ids == (1, 106) and config.bos_token_id == 2  # the wrapper's EOS ids
    assert config.final_logit_softcapping is None
    big = ModelConfig.from_hf({**GEMMA3_4B_IT, "text_config": {**GEMMA3_4B_IT["text_config"], **GEMMA3_27B_TEXT}})
    assert (big.head_dim, big.attention_scale, big.num_hidden_layers) == (128, 168 ** -0.5, 62)
    assert ModelConfig.from_hf(transformers.Gemma3Config(**GEMMA3_4B_IT)) == config


def test_prompt_logits_match_transformers(checkpoint, monkeypatch, caplog) -> None:
    hf, path = checkpoint
    read = []
    open_file = safetensors.safe_open

    class RecordingReader:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.reader = open_file(*args, **kwargs)

        def __enter__(self) -> RecordingReader:
            self.reader.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.reader.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.reader.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.reader.get_tensor(name)

    monkeypatch.setattr("vivace.models.loader.safe_open", RecordingReader)
    with caplog.at_level(logging.INFO, logger="vivace.models.loader"):
        loaded = load_model(str(path), torch.float32)
    assert "image inputs are not supported" in caplog.text
    assert read and not [name for name in read if name.startswith(VISION_PREFIXES)]
    assert loaded.config.eos_token_ids == (EOS_ID, OTHER_EOS)
    assert (loaded.model.lm_head is None) == (hf.config.tie_word_embeddings)
    ids = prompt(23, seed=1)
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], hf_logits(hf, ids))


def test_greedy_tokens_match_transformers(checkpoint) -> None:
    hf, path = checkpoint
    loaded = load_model(str(path), torch.float32)
    ids = prompt(11, seed=2)
    run, ours, chunk = PagedRun(loaded.model, loaded.config), [], ids
    for _ in range(16):
        ours.append(int(run.step({"a": chunk})["a"][-1].argmax()))
        chunk = ours[-1:]
    # Greedy is each next token the argmax of the logits given all before it.
    assert hf_logits(hf, ids + ours)[len(ids) - 1:-1].argmax(-1).tolist() == ours


def test_served_through_llm(hf_models, tmp_path) -> None:
    hf = hf_models[True]
    llm = LLM(str(save_hf_dir(hf, tmp_path)), num_kv_blocks=64, block_size=4)
    output = llm.generate("the hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    ids, ours = output.prompt_token_ids, output.outputs[0].token_ids
    assert len(ours) == 12
    assert hf_logits(hf, ids + ours)[len(ids) - 1:-1].argmax(-1).tolist() == ours
    llm.check_integrity()
