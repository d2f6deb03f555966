"""The FP8 kernels against a float32 torch reference (dequantize, then multiply): the weight-only
GEMV (M <= 8, split K or not), the weight-only GEMM and ``torch._scaled_mm`` with per-token
activation scales (larger M), with and without bias, bf16 and fp32 activations; the weight and
activation quantizers' codes and error bounds (on CPU under Triton's interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace.gpu import fp8_kernels, gguf_kernels  # noqa: E402
from vivace.gpu.fp8_kernels import FP8, fp8_matmul, quantize_rows, quantize_weight, scaled_mm_runs  # noqa: E402

from .conftest import DEVICE  # noqa: E402

N, K = 48, 160  # K not a multiple of the GEMV's or the GEMM's steps: masked tails
HALF_ULP = 2.0 ** -4  # e4m3: 3 mantissa bits, so rounding moves a normal value by at most 1/16 of it
SUBNORMAL_HALF_STEP = 2.0 ** -10  # below 2^-6, e4m3 is spaced 2^-9 apart (in units of the scale)


def random_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and per-row scales of a random weight whose rows differ in magnitude."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.5
    codes, scale = quantize_weight(weight)
    return codes.to(DEVICE), scale.to(DEVICE)


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ (codes.float() * scale[:, None]).T
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 40])
def test_weight_only_matmul_equals_dequantize_then_matmul(m, with_bias, dtype) -> None:
    codes, scale = random_weight(N, K, m)
    g = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, K, generator=g).to(DEVICE, dtype)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype) if with_bias else None
    y = fp8_matmul(x, codes, scale, bias, scaled_mm=False)
    assert y.dtype == dtype and y.shape == (m, N)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(y.float(), reference(x, codes, scale, bias), **tolerance)


@pytest.mark.parametrize("acc_2d", [False, True], ids=["reduce_each_step", "reduce_once"])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gemv_split_along_k_equals_unsplit(m, acc_2d, monkeypatch) -> None:
    monkeypatch.setattr(gguf_kernels, "GEMV_ACC_2D", acc_2d)  # the FP8 GEMV's too
    codes, scale = random_weight(N, 1024, m)
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    want = reference(x, codes, scale, bias)
    for splits in (1, 3, 4):
        torch.testing.assert_close(fp8_matmul(x, codes, scale, bias, splits=splits), want, rtol=1e-5, atol=1e-5)


def test_strided_rows_of_x() -> None:
    codes, scale = random_weight(N, K, 3)
    wide = torch.randn(3, 2 * K, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x = wide[:, :K]  # a row stride of 2K
    torch.testing.assert_close(fp8_matmul(x, codes, scale), reference(x, codes, scale, None), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not scaled_mm_runs(torch.device(DEVICE)), reason="this torch has no FP8 _scaled_mm here")
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_scaled_mm_multiplies_per_token_quantized_activations(with_bias) -> None:
    m = 33
    codes, scale = random_weight(N, K + 16, 11)  # _scaled_mm wants K and N multiples of 16
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(m, K + 16, generator=g) * torch.logspace(-2, 2, m)[:, None]).to(DEVICE, torch.bfloat16)
    bias = torch.randn(N, generator=g).to(DEVICE, torch.bfloat16) if with_bias else None
    assert fp8_kernels.uses_scaled_mm(x, N, bias)
    y = fp8_matmul(x, codes, scale, bias)
    assert y.dtype == torch.bfloat16
    # Exactly the product of the quantized operands, up to bf16 output rounding ...
    x_codes, x_scales = quantize_rows(x)
    want = reference(x_codes.float() * x_scales, codes, scale, bias)
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2 * want.abs().amax().item())
    # ... and near the float activations' product: rows of 100x different size each keep their precision.
    exact = reference(x, codes, scale, bias)
    error = (y.float() - exact).norm(dim=1) / exact.norm(dim=1)
    assert error.max() < 0.05


def test_quantize_rows_codes_and_scales() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 300, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 0.0, 1e3])[:, None]
    x[3, :4] = torch.tensor([124.3, -125.6, 31.4, 448.0]) / 448.0 * 4.0  # values that round up a binade
    x[3, 4] = 4.0  # the row's max
    x = x.to(DEVICE)
    codes, scales = quantize_rows(x)
    assert codes.dtype == FP8 and scales.shape == (6, 1)
    amax = x.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(scales, (amax / 448).clamp(min=1e-12), rtol=1e-6, atol=0)
    assert torch.equal(codes[4].float().cpu(), torch.zeros(300))  # an all-zero row
    # Round to nearest even, as torch's conversion: a GPU divides in another order, hence the tolerance.
    want = (x / scales).clamp(-448, 448).to(FP8).float()
    assert (codes.float() != want).float().mean() < 0.01
    value = codes.float() * scales
    assert ((value - x).abs() <= HALF_ULP * x.abs() + SUBNORMAL_HALF_STEP * scales).all()
    assert torch.equal(codes[3, :5].float().cpu(), torch.tensor([128.0, -128.0, 32.0, 448.0, 448.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_weight_is_within_half_an_e4m3_step(dtype) -> None:
    g = torch.Generator().manual_seed(9)
    weight = (torch.randn(64, 256, generator=g) * torch.logspace(-4, 1, 64)[:, None]).to(dtype)
    weight[7] = 0.0
    codes, scale = quantize_weight(weight)
    assert codes.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64,)
    torch.testing.assert_close(scale[:7], weight[:7].float().abs().amax(dim=1) / 448)
    value = codes.float() * scale[:, None]
    w = weight.float()
    assert ((value - w).abs() <= HALF_ULP * w.abs() + SUBNORMAL_HALF_STEP * scale[:, None]).all()
    assert torch.equal(value[7], torch.zeros(256))
    assert (codes.float().abs().amax(dim=1)[scale > 1e-12] == 448).all()  # each row's largest maps to e4m3's
    # Values already on the e4m3 grid come back exactly.
    assert torch.equal(quantize_weight(value)[0].float() * quantize_weight(value)[1][:, None], value)
