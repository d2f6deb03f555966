"""Partial rotary and LongRoPE on the CUDA backend (on CPU under Triton's interpreter where there is
no GPU): the forward's prompt logits equal transformers' in both LongRoPE regimes, and the q/k rows
of projections kept as stored (FP8 checkpoints, GGUF blocks) are reordered as the float ones are."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from models.gguf_export import write_gguf  # noqa: E402  (tests/ is on sys.path)
from models.tiny import PHI3_LONGROPE, hf_logits, prompt, save_hf_dir, tiny_model  # noqa: E402
from vivace.gpu.forward import linear  # noqa: E402
from vivace.gpu.fp8_linear import Fp8Linear  # noqa: E402
from vivace.gpu.gguf_linear import GgufLinear  # noqa: E402
from vivace.models import load_model  # noqa: E402

from .conftest import DEVICE, GGUF_TOKENIZERS_OF_5_18  # noqa: E402
from .test_fp8_linear import prompt_logits, write_fp8_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    hf = tiny_model("phi3", **PHI3_LONGROPE)
    return hf, save_hf_dir(hf, tmp_path_factory.mktemp("phi3_longrope"))


@pytest.mark.parametrize("served", [32, 64], ids=["short", "long"])
def test_forward_logits_equal_transformers(phi3, served: int) -> None:
    """Served within the original 32 positions, the short factors rotate; past them, the long ones,
    as transformers rotates a sequence longer than 32: the first positions of one, by causality."""
    hf, path = phi3
    loaded = load_model(str(path), torch.float32, device=DEVICE, max_model_len=served)
    ids = prompt(18, seed=21)
    sequence = ids if served <= 32 else ids + prompt(16, seed=22)
    want = hf_logits(hf, sequence)[:len(ids)]
    torch.testing.assert_close(prompt_logits(loaded.model, ids), want, rtol=0, atol=1e-4)


def test_fp8_checkpoint_rows_as_the_float_model_holds_them(phi3, tmp_path) -> None:
    hf, _ = phi3
    write_fp8_checkpoint(hf, tmp_path, "compressed-tensors-channel")
    kept = load_model(str(tmp_path), torch.float32, "fp8", device=DEVICE).model
    dense = load_model(str(tmp_path), torch.float32, "none").model  # dequantized on load
    for ours, theirs in zip(kept.layers, dense.layers):
        assert isinstance(ours.self_attn.qkv_proj, Fp8Linear)
        assert torch.equal(ours.self_attn.qkv_proj.dequantize().cpu(), theirs.self_attn.qkv_proj.weight)


@GGUF_TOKENIZERS_OF_5_18
def test_gguf_blocks_rows_as_the_float_model_holds_them(phi3, tmp_path) -> None:
    hf, _ = phi3
    path = write_gguf(hf, tmp_path / "phi3-q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    packed = load_model(str(path), torch.float32, "auto", device=DEVICE, packed_gguf=True).model
    dense = load_model(str(path), torch.float32, "none").model
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for ours, theirs in zip(packed.layers, dense.layers):
        assert isinstance(ours.self_attn.qkv_proj, GgufLinear)
        torch.testing.assert_close(linear(ours.self_attn.qkv_proj, x.to(DEVICE)).cpu(),
                                   F.linear(x, theirs.self_attn.qkv_proj.weight), rtol=1e-4, atol=1e-4)
