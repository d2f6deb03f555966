"""GGUF blocks of every natively run type: decoded codes against ``gguf.quants.dequantize``, and
``QuantizedLinear`` over them against dequantize + matmul (native kernel where it runs, else the
PyTorch fallback), at random shapes and batch sizes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vivace.layers.gguf_blocks import NATIVE_TYPES, from_gguf_blocks
from vivace.layers.linear import QuantizedLinear

from .gguf_random import random_blocks
from .test_linear import BACKENDS, relative_error

T = gguf.GGMLQuantizationType
EXACT = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
# Relative L2 error of the decoded weight: K-quant sub-block scales rounded to float16 (2^-11
# at most each), Q6_K's second sub-block per group rounded to its partner's step / 4 (module doc).
WEIGHT_TOLERANCE = {T.Q4_K: 5e-4, T.Q5_K: 5e-4, T.Q6_K: 1e-2}
SHAPES = [(16, 256), (48, 512), (33, 768), (160, 1024)]


@pytest.mark.parametrize("ggml_type", NATIVE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decoded_weight_matches_gguf_dequantize(ggml_type, shape) -> None:
    blocks = random_blocks(ggml_type, *shape, seed=shape[0])
    expected = gguf.quants.dequantize(blocks, ggml_type)
    weight = from_gguf_blocks(blocks, ggml_type)
    expected_bits = 4 if ggml_type in (T.Q4_0, T.Q4_1, T.Q4_K) else 5 if ggml_type in (T.Q5_0, T.Q5_1, T.Q5_K) else 8
    assert weight.group_size == 32 and weight.bits == expected_bits
    actual = weight.dequantize().numpy()
    if ggml_type in EXACT:
        np.testing.assert_array_equal(actual, expected)
    else:
        assert np.linalg.norm(actual - expected) / np.linalg.norm(expected) < WEIGHT_TOLERANCE[ggml_type]


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
    # The weight's own tolerance, plus (native) the int8 rounding of activations per group of
    # 32: ~0.5% relative on random data, as for the other formats.
    tolerance = WEIGHT_TOLERANCE.get(ggml_type, 1e-5) + (2e-2 if backend == "native" else 0)
    assert relative_error(layer(x), expected) < tolerance


def test_types_without_a_native_form_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Q3_K has no direct quantized form; supported: Q8_0, .*Q6_K"):
        from_gguf_blocks(np.zeros((16, 110), np.uint8), T.Q3_K)
