"""Tiny random models for engine tests, built here (no hub), with the default model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from vivace.models.loader import default_model_path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(out)
    return out


def build_tiny_llama(out: Path, tokenizer_dir: Path, seed: int = 0, **overrides: object) -> Path:
    config = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.08)
    config.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.save_pretrained(out, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
