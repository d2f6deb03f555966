"""GGUF blocks of every natively run type: decoded codes against ``gguf.quants.dequantize``, bits
a weight, and ``QuantizedLinear`` over them against dequantize + matmul (native kernel where it
runs, else the PyTorch fallback), at random shapes and batch sizes; the native kernel also against
the same matmul with its own int8 activations, which it must reproduce to float32 rounding (IQ4's
codebook too, and any other table of bytes)."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vivace.kernels import quant_linear_kernel
from vivace.layers.gguf_blocks import NATIVE_TYPES, from_gguf_blocks
from vivace.layers.linear import QuantizedLinear

from .gguf_random import random_blocks
from .test_linear import BACKENDS, relative_error

T = gguf.GGMLQuantizationType
BITS = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q2_K: 2, T.Q3_K: 3, T.Q4_K: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5,
        T.Q6_K: 6, T.IQ4_NL: 4, T.IQ4_XS: 4}
# Bits a weight that a layer reads (codes, scales, mins, sub-block scales and mins; IQ4's 16-byte
# codebook aside): the module docstring of vivace.layers.gguf_blocks.
BITS_PER_WEIGHT = {T.Q8_0: 8.5, T.Q4_0: 4.5, T.Q4_1: 5, T.Q5_0: 5.5, T.Q5_1: 6, T.Q2_K: 3.125, T.Q3_K: 3.5625,
                   T.Q4_K: 4.625, T.Q5_K: 5.625, T.Q6_K: 6.5625, T.IQ4_NL: 4.5, T.IQ4_XS: 4.5}
SUB_GROUPS = {T.Q2_K: 16, T.Q3_K: 16, T.Q4_K: 32, T.Q5_K: 32, T.Q6_K: 16}  # the K-quants'
# IQ4_XS's sub-block scales d * (ls - 32) are rounded to float16: half a unit in the last place,
# or half float16's subnormal step.
ROUNDED_SCALES = dict(rtol=2**-11, atol=127 * 2**-25)
SHAPES = [(16, 256), (48, 512), (33, 768), (160, 1024)]
needs_native = pytest.mark.skipif(quant_linear_kernel() is None, reason="native kernels unavailable")


@pytest.mark.parametrize("ggml_type", NATIVE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decoded_weight_matches_gguf_dequantize(ggml_type, shape) -> None:
    blocks = random_blocks(ggml_type, *shape, seed=shape[0])
    expected = gguf.quants.dequantize(blocks, ggml_type)
    weight = from_gguf_blocks(blocks, ggml_type)
    assert weight.bits == BITS[ggml_type]
    assert (weight.group_size, weight.sub_group) == ((256, SUB_GROUPS[ggml_type]) if ggml_type in SUB_GROUPS
                                                     else (32, 0))
    if ggml_type == T.IQ4_XS:
        np.testing.assert_allclose(weight.dequantize().numpy(), expected, **ROUNDED_SCALES)
    else:
        np.testing.assert_array_equal(weight.dequantize().numpy(), expected)


@pytest.mark.parametrize("ggml_type", NATIVE_TYPES, ids=lambda t: t.name)
def test_bits_per_weight(ggml_type) -> None:
    rows, cols = 64, 1024
    layer = QuantizedLinear.from_gguf(random_blocks(ggml_type, rows, cols), ggml_type)
    codebook = 0 if layer.codebook is None else layer.codebook.numel()
    assert 8 * (layer.weight_bytes() - codebook) / (rows * cols) == BITS_PER_WEIGHT[ggml_type]


@pytest.mark.parametrize(("ggml_type", "codes", "sub_scales", "sub_mins"),
                         [(T.Q3_K, 8, (-32, 31), None), (T.Q2_K, 4, (0, 15), (0, 15))], ids=["Q3_K", "Q2_K"])
def test_low_bit_k_quants_use_their_whole_ranges(ggml_type, codes, sub_scales, sub_mins) -> None:
    """Random bytes reach every code and every sub-block scale and min the format can store,
    and each lands where ``gguf.quants`` puts it (above): no bit of the packing unread."""
    weight = from_gguf_blocks(random_blocks(ggml_type, 64, 1024, seed=1), ggml_type)
    assert set(weight.codes.unique().tolist()) == set(range(codes))
    assert (weight.sub_scales.min().item(), weight.sub_scales.max().item()) == sub_scales
    if sub_mins is not None:
        assert (weight.sub_mins.min().item(), weight.sub_mins.max().item()) == sub_mins


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ggml_type", NATIVE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 5, 19, 300])  # the kernel's 1..7-row passes, 8-row passes, both
def test_linear_matches_gguf_dequantize_and_matmul(backend, ggml_type, m) -> None:
    rows, cols = SHAPES[m % len(SHAPES)]
    blocks = random_blocks(ggml_type, rows, cols, seed=m)
    layer = QuantizedLinear.from_gguf(blocks, ggml_type)
    layer.backend = backend
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    expected = F.linear(x, torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type)))
    # The weight is exact (above); native adds the int8 rounding of activations per group of
    # 32 (step amax / 127): ~0.5% relative on random data, as for the other formats.
    tolerance = 2e-2 if backend == "native" else 1e-3 if ggml_type == T.IQ4_XS else 1e-5  # ROUNDED_SCALES
    assert relative_error(layer(x), expected) < tolerance


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """The activations the native kernel multiplies by: int8 codes per group of 32 columns with
    step ``amax / 127``, computed as the kernel does (float32, times the reciprocal, rounded half
    to even), back in float64."""
    groups = x.view(x.shape[0], -1, 32)
    step = groups.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, 0.0)
    return (torch.round(groups * inverse).clamp(-128, 127) * step).double().view_as(x)


@needs_native
@pytest.mark.parametrize("ggml_type", NATIVE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 4, 19])  # passes of 1..7 rows, of 8 (AVX-512) or 4 (AVX2), both
def test_native_kernel_is_exact_integer_dot_products(ggml_type, m) -> None:
    """With its int8 activations given, the kernel's result is the file's weights times them,
    to float32 rounding (integer dot products per sub-block, the file's scales multiplied in
    float32): no error from the weight's scales or codes."""
    rows, cols = 48, 1024
    blocks = random_blocks(ggml_type, rows, cols, seed=7)
    layer = QuantizedLinear.from_gguf(blocks, ggml_type)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type)).double()
    if ggml_type == T.IQ4_XS:  # its scales as rounded (test_decoded_weight_matches_gguf_dequantize)
        weight = layer.dequantize().double()
    expected = int8_activations(x) @ weight.T
    assert relative_error(layer(x), expected) < 1e-6


# IQ4's table, the same reversed, and a random one of any bytes: 0 and 255 included, whose pairs of
# products would saturate AVX2's VPMADDUBSW (int16) if the kernel took them as they are.
ANY_BYTES = torch.tensor([255, 0, *torch.randint(1, 255, (14,), generator=torch.Generator().manual_seed(0))],
                         dtype=torch.uint8)
CODEBOOKS = {"iq4": lambda table: table, "reversed": lambda table: table.flip(0), "any bytes": lambda _: ANY_BYTES}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ggml_type", [T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("m", [1, 3, 16, 40])  # one pass of fewer rows, then whole passes with a rest
def test_codebook_reaches_the_kernel(backend, ggml_type, codebook, m) -> None:
    """The 4-bit codes are looked up in the weight's own table, whichever it is: the layer's output is
    its dequantized weight's matmul (with the native kernel's int8 activations, to float32 rounding),
    and a table other than IQ4's changes it."""
    blocks = random_blocks(ggml_type, 48, 512, seed=m)
    iq4 = from_gguf_blocks(blocks, ggml_type)
    weight = replace(iq4, codebook=CODEBOOKS[codebook](iq4.codebook))
    layer, iq4_layer = QuantizedLinear(weight), QuantizedLinear(iq4)
    layer.backend = iq4_layer.backend = backend
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    expected = F.linear(x, weight.dequantize())
    assert relative_error(layer(x), expected) < (2e-2 if backend == "native" else 1e-5)
    if backend == "native":
        assert relative_error(layer(x), int8_activations(x) @ weight.dequantize().double().T) < 1e-6
    assert (relative_error(layer(x), iq4_layer(x)) > 0.1) == (codebook != "iq4")


def test_iq4_widened_is_the_same_weight() -> None:
    """``widened`` (the 8-bit form IQ4 ran as before, benchmarks/kernels.py's baseline) looks the codes up."""
    weight = from_gguf_blocks(random_blocks(T.IQ4_XS, 16, 256), T.IQ4_XS)
    widened = weight.widened()
    assert (widened.bits, widened.codebook) == (8, None)
    torch.testing.assert_close(widened.dequantize(), weight.dequantize(), rtol=0, atol=0)

@pytest.mark.parametrize("change", [dict(bits=8), dict(mins=torch.zeros(16, 8, dtype=torch.float16)),
                                    dict(codebook=torch.arange(8, dtype=torch.uint8)),
                                    dict(codebook=torch.arange(16, dtype=torch.int8))], ids=str)
def test_a_codebook_needs_16_bytes_and_4_bit_codes_with_a_zero_point(change) -> None:
    iq4 = from_gguf_blocks(random_blocks(T.IQ4_NL, 16, 256), T.IQ4_NL)
    with pytest.raises(ValueError, match="codebook"):
        replace(iq4, **change)


def test_types_without_a_native_form_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="IQ2_XXS has no direct quantized form; supported: Q8_0, .*Q2_K, Q3_K, .*Q6_K"):
        from_gguf_blocks(np.zeros((16, 66), np.uint8), T.IQ2_XXS)


@needs_native
@pytest.mark.parametrize(("bits", "sub_group", "with_mins"), [(2, 0, True), (3, 0, False), (2, 16, False),
                                                              (3, 16, True), (4, 16, False), (4, 16, True),
                                                              (5, 16, True), (6, 16, True), (4, 32, False),
                                                              (6, 32, False), (8, 32, True)])
def test_kernel_refuses_forms_it_has_no_loop_for(bits, sub_group, with_mins) -> None:
    """Codes and scales the loops were not written for (2- and 3-bit codes with one level of
    scales, a K-quant's sub-block width or mins with the wrong codes) are an error, not a wrong sum."""
    n, k = 16, 256
    codes = torch.zeros(n * k * bits // 8, dtype=torch.uint8)
    scales = torch.zeros(n // 16, k // 256, 16, dtype=torch.int16)
    subs = torch.zeros(n // 16, k // sub_group, 16, dtype=torch.int8) if sub_group else None
    with pytest.raises(RuntimeError, match="no known form"):
        quant_linear_kernel()(torch.randn(1, k), codes, scales, scales if with_mins else None, None, bits, n, 256,
                              0 if with_mins else 4, subs, subs if with_mins else None, sub_group)


@needs_native
@pytest.mark.parametrize(("bits", "with_mins"), [(8, False), (5, False), (4, True)])
def test_kernel_refuses_a_codebook_but_with_4_bit_codes_and_a_zero_point(bits, with_mins) -> None:
    n, k = 16, 256
    codes = torch.zeros(n * k * bits // 8, dtype=torch.uint8)
    scales = torch.zeros(n // 16, k // 32, 16, dtype=torch.int16)
    with pytest.raises(RuntimeError, match="no known form"):
        quant_linear_kernel()(torch.randn(1, k), codes, scales, scales if with_mins else None, None, bits, n, 32, 128,
                              None, None, 0, torch.zeros(16, dtype=torch.uint8))
