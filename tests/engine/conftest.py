"""Engine fixtures: the tiny random Llama of tests/conftest.py, also loaded by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
