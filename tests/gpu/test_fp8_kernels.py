"""The FP8 kernels against a float32 torch reference (dequantize, then multiply): the weight-only
GEMV (M <= 8) under several tilings (rows a program, columns a step, K splits, acc_2d) and the
tilings it offers the start-up tuner, the weight-only GEMM and ``torch._scaled_mm`` with per-token
activation scales (larger M), with and without bias, bf16 and fp32 activations; the weight and
activation quantizers' codes and error bounds (on CPU under Triton's interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace.gpu import fp8_kernels  # noqa: E402
from vivace.gpu.fp8_kernels import FP8, fp8_matmul, quantize_rows, quantize_weight, scaled_mm_runs  # noqa: E402
from vivace.gpu.kernels import GemvConfig  # noqa: E402

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
@pytest.mark.parametrize("m", [1, 2, 3, 9, 40])
def test_weight_only_matmul_equals_dequantize_then_matmul(m, with_bias, dtype) -> None:
    codes, scale = random_weight(N, K, m)
    g = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, K, generator=g).to(DEVICE, dtype)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype) if with_bias else None
    y = fp8_matmul(x, codes, scale, bias, scaled_mm=False)
    assert y.dtype == dtype and y.shape == (m, N)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(y.float(), reference(x, codes, scale, bias), **tolerance)


# One warp: 32 chunks a step, 128 columns of float32 x or 256 of bf16, so that K = 512 takes
# several steps and splits at the interpreter's speed. Rows of W a program (fewer for more rows of
# x), columns a step, K splits and acc_2d (one row of x only) change the order of summation only.
F32, BF16 = torch.float32, torch.bfloat16
GEMV_CASES = [(1, GemvConfig(8, 128, None, False, 1), F32), (1, GemvConfig(4, 128, 3, False, 1), BF16),
              (1, GemvConfig(8, 128, 4, True, 1), F32), (2, GemvConfig(16, 256, 2, True, 1), BF16),
              (3, GemvConfig(8, 128, None, False, 1), F32), (8, GemvConfig(16, 256, 2, False, 1), F32),
              (8, GemvConfig(2, 512, None, False, 1), BF16)]


@pytest.mark.parametrize(("m", "config", "dtype"), GEMV_CASES, ids=str)
def test_gemv_tilings_equal_dequantize_then_matmul(m, config, dtype) -> None:
    k = 512
    codes, scale = random_weight(44, k, m)  # 44 rows: a partial block of rows
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(44, generator=g).to(DEVICE, dtype)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == F32 else dict(rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(fp8_matmul(x, codes, scale, bias, config).float(), reference(x, codes, scale, bias),
                               **tolerance)


def test_gemv_tiling_keeps_its_registers_for_more_rows_of_x() -> None:
    config = GemvConfig(16, 1024, None, True, 4)  # chosen at one row of x
    for m, rows, acc_2d in ((1, 16, True), (2, 8, False), (3, 8, False), (8, 4, False)):
        tiling = fp8_kernels.gemv_tiling(m, BF16, config)
        assert (tiling["BLOCK_N"], tiling["ACC_2D"], tiling["CHUNKS"], tiling["WORDS"]) == (rows, acc_2d, 128, 2)
    assert fp8_kernels.gemv_tiling(2, F32, config)["BLOCK_N"] == 16  # float32 x: 4 columns a chunk
    assert fp8_kernels.gemv_tiling(1, F32, GemvConfig(8, 64, None, False, 4))["CHUNKS"] == 128  # one a thread
    with pytest.raises(ValueError, match="powers of 2"):
        fp8_kernels.gemv_tiling(1, BF16, GemvConfig(12, 1024))


def test_gemv_candidates_are_tilings_the_launcher_takes() -> None:
    for n, k, sms in ((6144, 4096, 132), (4096, 14336, 132), (2048, 8192, 132), (576, 576, 1)):
        candidates = fp8_kernels.gemv_candidates(n, k, sms)
        assert candidates[0] == fp8_kernels.GEMV_DEFAULT and 5 <= len(candidates) <= 12
        assert len(set(candidates)) == len(candidates)
        for config in candidates:
            tiling = fp8_kernels.gemv_tiling(1, BF16, config)
            assert tiling["CHUNKS"] * 8 == config.block_k and tiling["BLOCK_N"] == config.block_n
            assert config.splits is None or 1 <= config.splits <= max(1, k // config.block_k)
    assert GemvConfig(8, 1024, 1, False, 4) in fp8_kernels.gemv_candidates(4096, 14336, 132)  # unsplit vs 3
    codes, scale = random_weight(24, 576, 0)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    want = reference(x, codes, scale, None)
    for config in fp8_kernels.gemv_candidates(24, 576, 1):
        torch.testing.assert_close(fp8_matmul(x, codes, scale, config=config), want, rtol=1e-5, atol=1e-4)


def test_k_not_a_multiple_of_4_takes_the_gemm() -> None:
    codes, scale = random_weight(N, 162, 4)
    x = torch.randn(2, 162, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    torch.testing.assert_close(fp8_matmul(x, codes, scale), reference(x, codes, scale, None), rtol=1e-5, atol=1e-5)


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
