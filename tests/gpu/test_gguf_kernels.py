"""The GGUF-block matmuls of ``vivace.gpu.gguf_kernels`` against ``gguf``'s dequantize, then a
float32 matmul: every type, GEMV (M <= 8), GEMM (M <= 64) and dequantize + cuBLAS (more rows) paths, several K, bfloat16 and float32
activations, split K and bias. Blocks are random bytes with modest float16 scales, as
``tests/layers/gguf_random.py`` makes them (``gguf`` cannot quantize to every type)."""

from __future__ import annotations

import gguf
import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from layers.gguf_random import random_blocks  # noqa: E402  (tests/ is on sys.path)
from vivace.gpu import gguf_kernels  # noqa: E402
from vivace.gpu.gguf_kernels import GPU_TYPES, LAYOUTS, gguf_matmul  # noqa: E402

from .conftest import DEVICE  # noqa: E402

T = gguf.GGMLQuantizationType
N = 40  # output rows: more than one GEMV program, not a multiple of its rows


def reference(x: torch.Tensor, blocks, ggml_type, bias: torch.Tensor | None = None) -> torch.Tensor:
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type))
    y = x.float().cpu() @ weight.T
    return y if bias is None else y + bias.float().cpu()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-2 relative, each element against the output's scale (a near-zero sum has none)."""
    actual = actual.float().cpu()
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def columns(ggml_type) -> list[int]:
    """Several K: one block, a few (not a whole kernel tile), many."""
    width = LAYOUTS[ggml_type].block_cols
    return [width, 3 * width, 1024]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 20, 70], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("ggml_type", GPU_TYPES, ids=lambda t: t.name)
def test_matmul_equals_dequantize_then_matmul(ggml_type, m: int, dtype: torch.dtype) -> None:
    for k in columns(ggml_type):
        blocks = random_blocks(ggml_type, N, k, seed=k + m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        y = gguf_matmul(x.to(DEVICE), torch.from_numpy(blocks).to(DEVICE), ggml_type)
        assert y.dtype == dtype and y.shape == (m, N)
        assert_close(y, reference(x, blocks, ggml_type))


@pytest.mark.parametrize("acc_2d", [False, True], ids=["reduce_each_step", "reduce_once"])
@pytest.mark.parametrize("m", [2, 24, 70], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q6_K], ids=lambda t: t.name)
def test_bias_and_split_k(ggml_type, m: int, acc_2d: bool, monkeypatch) -> None:
    monkeypatch.setattr(gguf_kernels, "GEMV_ACC_2D", acc_2d)
    k = 8 * LAYOUTS[ggml_type].block_cols
    blocks = random_blocks(ggml_type, N, k, seed=3)
    g = torch.Generator().manual_seed(4)
    x, bias = torch.randn(m, k, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
    expected = reference(x, blocks, ggml_type, bias)
    w = torch.from_numpy(blocks).to(DEVICE)
    for splits in (1, 3):  # 3 splits of uneven length (the GEMM path ignores them)
        assert_close(gguf_matmul(x.to(DEVICE), w, ggml_type, bias.to(DEVICE), splits=splits), expected)


def test_non_contiguous_rows_of_x() -> None:
    k = 256
    blocks = random_blocks(T.Q8_0, N, k)
    x = torch.randn(3, 2 * k)[:, :k]  # row stride 2k
    assert_close(gguf_matmul(x.to(DEVICE), torch.from_numpy(blocks).to(DEVICE), T.Q8_0), reference(x, blocks, T.Q8_0))


def test_many_rows_dequantize_in_slices(monkeypatch) -> None:
    """A weight larger than a slice is dequantized and multiplied a slice of rows at a time."""
    k = 2 * LAYOUTS[T.Q4_K].block_cols
    monkeypatch.setattr(gguf_kernels, "DEQUANT_SLICE_BYTES", 64 * k * 4)  # 64 rows of float32 a slice: 3 slices
    blocks = random_blocks(T.Q4_K, 150, k, seed=8)
    g = torch.Generator().manual_seed(9)
    x, bias = torch.randn(70, k, generator=g), torch.randn(150, generator=g)
    y = gguf_matmul(x.to(DEVICE), torch.from_numpy(blocks).to(DEVICE), T.Q4_K, bias.to(DEVICE))
    assert y.shape == (70, 150)
    assert_close(y, reference(x, blocks, T.Q4_K, bias))


def test_gemv_splits_fill_the_gpu_only_when_k_is_long() -> None:
    # Llama-3.1-8B's down projection at batch 1, Q4_0: 256 programs of rows on an H100's 132 SMs.
    layout = LAYOUTS[T.Q4_0]
    units, rows = 14336 // layout.unit_cols, 4096 // gguf_kernels.GEMV_BLOCK_N
    splits = gguf_kernels.gemv_splits(rows, units, 8, 132)
    assert splits > 1 and rows * splits >= gguf_kernels.PROGRAMS_PER_SM * 132
    assert gguf_kernels.gemv_splits(rows, 4 * 8, 8, 132) == 1  # K too short to split
    assert gguf_kernels.gemv_splits(100_000, units, 8, 132) == 1  # rows enough already


def test_rejects_blocks_that_do_not_fit_k() -> None:
    blocks = torch.from_numpy(random_blocks(T.Q4_K, 4, 512))
    with pytest.raises(AssertionError, match="do not hold 256 columns"):
        gguf_matmul(torch.randn(1, 256), blocks, T.Q4_K)


@pytest.mark.parametrize("m", [1, 20], ids=lambda m: f"m{m}")
def test_float16_activations(m: int) -> None:
    blocks = random_blocks(T.Q4_K, N, 512, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).half()
    y = gguf_matmul(x.to(DEVICE), torch.from_numpy(blocks).to(DEVICE), T.Q4_K)
    assert y.dtype == torch.float16
    assert_close(y, reference(x, blocks, T.Q4_K))
