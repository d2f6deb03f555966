"""QuantizedLinear against a dequantized reference matmul, on the native and fallback paths."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vivace.kernels import quant_linear_kernel
from vivace.layers import quant_format as qf
from vivace.layers.gguf_blocks import from_gguf_blocks
from vivace.layers.linear import QuantizedLinear

from .gguf_random import random_blocks

BACKENDS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    quant_linear_kernel() is None, reason="native kernels unavailable (CPU without AVX-512 VNNI, or build failed)"))]
GGUF_TYPES = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def check_against_reference(layer: QuantizedLinear, backend: str, m: int, dtype: torch.dtype) -> None:
    layer.backend = backend
    x = torch.randn(m, layer.in_features).to(dtype)
    bias = None if layer.bias is None else layer.bias[: layer.out_features]
    expected = F.linear(x.float(), layer.dequantize(), bias)
    actual = layer(x)
    assert actual.shape == (m, layer.out_features) and actual.dtype == dtype
    # The native path quantizes activations to int8 per group of 32: ~0.5% relative error.
    tolerance = {("torch", torch.float32): 1e-5}.get((backend, dtype), 2e-2)
    assert relative_error(actual, expected) < tolerance


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 17, 300])  # every remainder pass of the kernel
@pytest.mark.parametrize("with_bias", [False, True])
def test_from_float_matches_dequantized_reference(backend: str, mode: str, m: int, with_bias: bool) -> None:
    torch.manual_seed(m)
    weight = torch.randn(96, 160) * 0.1
    bias = torch.randn(96) if with_bias else None
    check_against_reference(QuantizedLinear.from_float(weight, bias, mode), backend, m, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 17])
def test_gguf_blocks_match_reference(backend: str, ggml_type: gguf.GGMLQuantizationType, m: int) -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 128)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, ggml_type)
    layer = QuantizedLinear.from_gguf(blocks, ggml_type, torch.randn(48))
    np.testing.assert_array_equal(layer.dequantize().numpy(), gguf.quants.dequantize(blocks, ggml_type))
    check_against_reference(layer, backend, m, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_input_and_odd_out_features(backend: str) -> None:
    layer = QuantizedLinear.from_float(torch.randn(37, 64), torch.randn(37), "int4")
    check_against_reference(layer, backend, 5, torch.bfloat16)


def test_quantization_error_is_small() -> None:
    weight = torch.randn(64, 256)
    for mode, bound in (("int8", 0.01), ("int4", 0.1)):
        layer = QuantizedLinear.from_float(weight, mode=mode)
        assert relative_error(layer.dequantize(), weight) < bound


@pytest.mark.parametrize("ggml_type", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0,
                                       gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q2_K,
                                       gguf.GGMLQuantizationType.Q3_K, gguf.GGMLQuantizationType.Q4_K,
                                       gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.IQ4_NL],
                         ids=lambda t: t.name)
def test_rows_and_leading_dims(ggml_type) -> None:
    blocks = random_blocks(ggml_type, 40, 256)
    layer = QuantizedLinear.from_gguf(blocks, ggml_type)
    rows = torch.tensor([0, 17, 39, 17])
    torch.testing.assert_close(layer.quantized_rows(rows).dequantize(), layer.dequantize()[rows])
    torch.testing.assert_close(layer.dequantize(), torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type)))
    assert layer(torch.randn(2, 3, 256)).shape == (2, 3, 40)


def test_tiling_round_trips() -> None:
    for bits in (2, 3, 4, 5, 6, 8):
        codes = torch.randint(0, 1 << bits, (32, 64), dtype=torch.uint8)
        assert torch.equal(qf.untile_codes(qf.tile_codes(codes, bits), bits), codes)
    for values in (torch.randn(32, 2).to(torch.float16), torch.randint(-128, 128, (32, 16), dtype=torch.int8)):
        assert torch.equal(qf.untile_groups(qf.tile_groups(values)), values)


def test_module_to_dtype_keeps_the_weight() -> None:
    layer = QuantizedLinear.from_float(torch.randn(32, 64), torch.randn(32), "int4")
    expected = layer.dequantize()
    layer.to(torch.bfloat16)
    torch.testing.assert_close(layer.dequantize(), expected)
    assert layer(torch.randn(2, 64).bfloat16()).dtype == torch.bfloat16


def test_rejects_bad_shapes_and_modes() -> None:
    with pytest.raises(ValueError):
        QuantizedLinear.from_float(torch.randn(16, 40), mode="int8")
    with pytest.raises(ValueError):
        QuantizedLinear.from_float(torch.randn(16, 64), mode="int2")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        from_gguf_blocks(np.zeros((16, 66), np.uint8), gguf.GGMLQuantizationType.IQ2_XXS)


def test_fallback_forced_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIVACE_KERNELS", "torch")
    assert quant_linear_kernel() is None
