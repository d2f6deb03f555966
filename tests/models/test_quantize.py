"""load_model(..., quantization=): every projection quantized, logits near the float model's,
and GGUF Q8_0/Q4_1 tensors taken code for code (q/k rows un-permuted, q/k/v and gate/up fused)."""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn

from vivace.layers.linear import QuantizedLinear
from vivace.models import load_model
from vivace.models.quantize import native_quantization, quantize_model

from .gguf_export import write_gguf
from .tiny import PagedRun, prompt

# Relative L2 error of the logits allowed against the float model. Random Gaussian weights are
# hard on int4 (~8% error per weight, compounded over layers); a wiring mistake gives ~100%.
BOUNDS = {"int8": 0.03, "int4": 0.3}


def logits(path: str, quantization: str) -> tuple[torch.Tensor, nn.Module]:
    loaded = load_model(path, torch.float32, quantization)
    return PagedRun(loaded.model, loaded.config).step({"a": prompt(19, seed=8)})["a"], loaded.model


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama_bias", "qwen2"])
def test_quantized_logits_track_float(tiny, kind: str, mode: str) -> None:
    path = str(tiny(kind).path)
    expected, _ = logits(path, "none")
    actual, model = logits(path, mode)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.bits == 8
    assert ((actual - expected).norm() / expected.norm()).item() < BOUNDS[mode]


@pytest.mark.parametrize(("ggml_type", "mode"), [(gguf.GGMLQuantizationType.Q8_0, "int8"),
                                                 (gguf.GGMLQuantizationType.Q4_1, "int4")], ids=["q8_0", "q4_1"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_codes_are_taken_as_stored(tiny, tmp_path, kind: str, ggml_type, mode: str) -> None:
    path = str(write_gguf(tiny(kind).hf, tmp_path / "model.gguf", ggml_type))
    reference = load_model(path, torch.float32).model  # the file's values, dequantized
    quantized = load_model(path, torch.float32, mode).model
    for name, module in quantized.named_modules():
        if isinstance(module, QuantizedLinear) and name != "lm_head":
            torch.testing.assert_close(module.dequantize(), reference.get_submodule(name).weight, rtol=0, atol=0)


def test_rejects_unknown_mode(tiny) -> None:
    model = load_model(str(tiny("llama").path), torch.float32).model
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(model, "int3")


@pytest.mark.parametrize(("ggml_type", "mode"), [(gguf.GGMLQuantizationType.Q8_0, "int8"),
                                                 (gguf.GGMLQuantizationType.Q4_1, "int4"),
                                                 (gguf.GGMLQuantizationType.F16, "none")], ids=["q8_0", "q4_1", "f16"])
def test_auto_runs_a_gguf_in_its_own_format(tiny, tmp_path, ggml_type, mode: str) -> None:
    path = write_gguf(tiny("llama").hf, tmp_path / "model.gguf", ggml_type)
    assert native_quantization(path) == mode
    model = load_model(str(path), torch.float32, "auto").model
    bits = {m.bits for m in model.layers.modules() if isinstance(m, QuantizedLinear)}
    assert bits == {"int8": {8}, "int4": {4}, "none": set()}[mode]


def test_auto_keeps_a_float_checkpoint_float(tiny) -> None:
    model = load_model(str(tiny("llama").path), torch.float32, "auto").model
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
