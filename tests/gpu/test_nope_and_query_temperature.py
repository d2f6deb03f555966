"""SmolLM3's NoPE layers (an identity rotary table) and Ministral 3's query temperature by position
on the CUDA backend (on CPU under Triton's interpreter where there is no GPU): a prompt step (the
rotary + K/V-write and prefill kernels) and a decode step (the decode kernel that rotates as it
attends) give transformers' logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from models.test_mistral3 import text_config  # noqa: E402  (tests/ is on sys.path)
from models.test_smollm3 import TWO_LAYERS, smollm3_config  # noqa: E402
from models.tiny import hf_logits, prompt, random_model, save_hf_dir  # noqa: E402
from vivace.gpu.forward import GpuBatch, forward, prompt_batch  # noqa: E402
from vivace.models import load_model  # noqa: E402

from .conftest import DEVICE  # noqa: E402

# 20 positions: Ministral 3's queries scale up from position 16, in the prompt step and the decode.
LENGTH, BLOCK_SIZE = 20, 4
MODELS = {"smollm3": lambda: smollm3_config(**TWO_LAYERS), "ministral3": lambda: text_config("ministral3")}


@pytest.mark.parametrize("name", MODELS)
@torch.inference_mode()
def test_prompt_and_decode_logits_equal_transformers(name: str, tmp_path) -> None:
    hf = random_model(MODELS[name]())
    loaded = load_model(str(save_hf_dir(hf, tmp_path)), torch.float32, device=DEVICE)
    config, model = loaded.config, loaded.model
    assert config.nope_layers or config.query_temperature
    ids = prompt(LENGTH, seed=5)
    caches = [torch.zeros(2, LENGTH // BLOCK_SIZE, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                          device=DEVICE) for _ in range(config.num_hidden_layers)]
    prefill = prompt_batch(torch.tensor(ids[:-1], device=DEVICE), BLOCK_SIZE)
    first = model.compute_logits(forward(model, prefill, caches)).cpu()
    position = torch.tensor([LENGTH - 1], device=DEVICE)
    decode = GpuBatch(torch.tensor(ids[-1:], device=DEVICE), position, position.clone(),
                      prefill.block_tables, torch.tensor([LENGTH], dtype=torch.int32, device=DEVICE))
    last = model.compute_logits(forward(model, decode, caches)).cpu()
    torch.testing.assert_close(torch.cat([first, last]), hf_logits(hf, ids), rtol=0, atol=1e-4)
