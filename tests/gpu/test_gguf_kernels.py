"""The GGUF matmuls of ``vivace.gpu.gguf_kernels`` against ``gguf``'s dequantize, then a float32
matmul: every type through the GEMV (M <= 8, at several tilings, split K, both accumulations),
the GEMM (M <= 64) and dequantize + cuBLAS (more rows), bfloat16, float16 and float32 activations,
bias; the planar rows against the file's bytes, field by field as ggml's structs lay them out.
Blocks are random bytes with modest float16 scales, as ``tests/layers/gguf_random.py`` makes them
(``gguf`` cannot quantize to every type)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from layers.gguf_random import random_blocks  # noqa: E402  (tests/ is on sys.path)
from vivace.gpu import gguf_kernels  # noqa: E402
from vivace.gpu.gguf_kernels import GPU_TYPES, LAYOUTS, gguf_matmul, planar  # noqa: E402
from vivace.gpu.kernels import GemvConfig  # noqa: E402

from .conftest import DEVICE  # noqa: E402

T = gguf.GGMLQuantizationType
N = 40  # output rows: more than one GEMV program, not a multiple of its rows


def reference(x: torch.Tensor, blocks: np.ndarray, ggml_type, bias: torch.Tensor | None = None) -> torch.Tensor:
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type))
    y = x.float().cpu() @ weight.T
    return y if bias is None else y + bias.float().cpu()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-2 relative, each element against the output's scale (a near-zero sum has none)."""
    actual = actual.float().cpu()
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def device_planes(blocks: np.ndarray, ggml_type) -> torch.Tensor:
    return planar(torch.from_numpy(blocks).to(DEVICE), ggml_type)


def expected_planes(blocks: np.ndarray, ggml_type) -> np.ndarray:
    """The planar rows, from ggml's block structs (block_q4_K: d, dmin, scales[12], qs[128]; ...)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, LAYOUTS[ggml_type].block_bytes)
    meta = np.concatenate([b[..., 4:16], b[..., 0:4]], -1)  # K-quants: scales, d, dmin
    if ggml_type == T.Q8_0:
        planes = [b[..., 2:34] ^ 128, b[..., 0:2]]
    elif ggml_type == T.Q4_0:
        planes = [b[..., 2:18], b[..., 0:2]]
    elif ggml_type == T.Q4_1:
        planes = [b[..., 4:20], b[..., 0:2], b[..., 2:4]]
    elif ggml_type == T.Q5_0:  # block_q5_0: d, qh[4], qs[16]
        planes = [b[..., 6:22], b[..., 2:6], b[..., 0:2]]
    elif ggml_type == T.Q5_1:  # block_q5_1: d, m, qh[4], qs[16]
        planes = [b[..., 8:24], b[..., 4:8], b[..., 0:2], b[..., 2:4]]
    elif ggml_type == T.Q4_K:
        planes = [b[..., 16:144], meta]
    elif ggml_type == T.Q5_K:  # per chunk c of qs, half h of its columns: bit 2k + p = fifth bit of column
        bits = (b[..., 16:48, None] >> np.arange(8)) & 1  # 16h + k of sub-block 2c + p: [n, S, column, sub-block]
        bits = bits.reshape(n, -1, 2, 16, 4, 2).transpose(0, 1, 4, 2, 3, 5).reshape(n, -1, 4, 2, 32)  # c, h, 2k + p
        words = (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1).astype("<u4")
        planes = [b[..., 48:176], words.view(np.uint8).reshape(n, -1, 32), meta]
    else:  # Q6_K: ql[128], qh[64], scales[16], d; per (half h, quarter t): its ql runs, its 4 scales
        ql, scales = b[..., :128].reshape(n, -1, 2, 2, 2, 16), b[..., 192:208].reshape(n, -1, 2, 4, 2)
        planes = [ql[:, :, :, 0].reshape(n, -1, 64), ql[:, :, :, 1].reshape(n, -1, 64), b[..., 128:192],
                  scales.transpose(0, 1, 2, 4, 3).reshape(n, -1, 16), b[..., 208:210]]
    return np.concatenate([plane.reshape(n, -1) for plane in planes], 1)


@pytest.mark.parametrize("ggml_type", GPU_TYPES, ids=lambda t: t.name)
def test_planar_rows_are_the_files_bytes_in_planes(ggml_type) -> None:
    blocks = random_blocks(ggml_type, 3, 512, seed=1)
    planes = device_planes(blocks, ggml_type)
    assert planes.shape == blocks.shape and planes.dtype == torch.uint8
    np.testing.assert_array_equal(planes.cpu().numpy(), expected_planes(blocks, ggml_type))


def columns(ggml_type, blocks: int, super_blocks: int) -> int:
    """K of ``blocks`` 32-wide blocks, or of ``super_blocks`` for the K-quants' 256-wide ones."""
    width = LAYOUTS[ggml_type].block_cols
    return width * (blocks if width == 32 else super_blocks)


# (M, K in blocks, K in super-blocks, dtype): one row of x (several GEMV steps, Q4_0/Q6_K a partial
# last one), rows of x up to GEMV_MAX_ROWS, the GEMM, dequantize + F.linear.
SHAPES = [(1, 33, 5, torch.bfloat16), (3, 3, 1, torch.float32), (20, 9, 2, torch.bfloat16), (70, 2, 1, torch.float32)]


@pytest.mark.parametrize("m, blocks_k, super_blocks_k, dtype", SHAPES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("ggml_type", GPU_TYPES, ids=lambda t: t.name)
def test_matmul_equals_dequantize_then_matmul(ggml_type, m: int, blocks_k: int, super_blocks_k: int,
                                              dtype: torch.dtype) -> None:
    k = columns(ggml_type, blocks_k, super_blocks_k)
    blocks = random_blocks(ggml_type, N, k, seed=k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    y = gguf_matmul(x.to(DEVICE), device_planes(blocks, ggml_type), ggml_type)
    assert y.dtype == dtype and y.shape == (m, N)
    assert_close(y, reference(x, blocks, ggml_type))


@pytest.mark.parametrize("ggml_type", GPU_TYPES, ids=lambda t: t.name)
def test_gemv_tilings_split_and_accumulations(ggml_type) -> None:
    """Rows of W a program, K a step (one unit, several), splits of uneven length, both
    accumulations, two rows of x: all the same product (+ bias)."""
    unit, k = LAYOUTS[ggml_type].unit_cols, columns(ggml_type, 9, 3)
    blocks = random_blocks(ggml_type, N, k, seed=3)
    g = torch.Generator().manual_seed(4)
    x, bias = torch.randn(2, k, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
    w = device_planes(blocks, ggml_type)
    configs = [(1, GemvConfig(block_n=8, block_k=unit, splits=2, acc_2d=True)),
               (1, GemvConfig(block_n=32, block_k=4 * unit, splits=2, acc_2d=False, num_warps=8)),
               (2, GemvConfig(block_n=16, block_k=2 * unit, splits=3, acc_2d=True))]
    for m, config in configs:
        assert_close(gguf_matmul(x[:m].to(DEVICE), w, ggml_type, bias.to(DEVICE), config),
                     reference(x[:m], blocks, ggml_type, bias))


def test_gemv_candidates_for_hopper(monkeypatch) -> None:
    """Llama-3.1-8B's down projection on an H100's 132 SMs: 12 distinct tilings of whole units,
    the default first, both accumulations, fewer splits than the launcher's and none."""
    monkeypatch.setattr(gguf_kernels, "num_sms", lambda device: 132)
    for ggml_type in GPU_TYPES:
        candidates = gguf_kernels.gemv_candidates(ggml_type, 4096, 14336, torch.device("cuda"))
        assert candidates[0] == gguf_kernels.default_gemv_config(ggml_type)
        assert len(set(candidates)) == len(candidates) == 12
        assert all(c.block_k % LAYOUTS[ggml_type].unit_cols == 0 and c.num_warps in (4, 8) for c in candidates)
        assert {c.acc_2d for c in candidates} == {False, True} and {None, 1} < {c.splits for c in candidates}


def test_non_contiguous_rows_of_x() -> None:
    k = 256
    blocks = random_blocks(T.Q8_0, N, k)
    x = torch.randn(3, 2 * k)[:, :k]  # row stride 2k
    assert_close(gguf_matmul(x.to(DEVICE), device_planes(blocks, T.Q8_0), T.Q8_0), reference(x, blocks, T.Q8_0))


def test_many_rows_dequantize_in_slices(monkeypatch) -> None:
    """A weight larger than a slice is dequantized and multiplied a slice of rows at a time."""
    k = 2 * LAYOUTS[T.Q4_K].block_cols
    monkeypatch.setattr(gguf_kernels, "DEQUANT_SLICE_BYTES", 64 * k * 4)  # 64 rows of float32 a slice: 3 slices
    blocks = random_blocks(T.Q4_K, 150, k, seed=8)
    g = torch.Generator().manual_seed(9)
    x, bias = torch.randn(70, k, generator=g), torch.randn(150, generator=g)
    y = gguf_matmul(x.to(DEVICE), device_planes(blocks, T.Q4_K), T.Q4_K, bias.to(DEVICE))
    assert y.shape == (70, 150)
    assert_close(y, reference(x, blocks, T.Q4_K, bias))


def test_dequantize_is_exact() -> None:
    for ggml_type in GPU_TYPES:
        blocks = random_blocks(ggml_type, 8, 256, seed=5)
        weight = gguf_kernels.dequantize(device_planes(blocks, ggml_type), ggml_type, 256, torch.float32)
        np.testing.assert_array_equal(weight.cpu().numpy(), gguf.quants.dequantize(blocks, ggml_type))


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
    y = gguf_matmul(x.to(DEVICE), device_planes(blocks, T.Q4_K), T.Q4_K)
    assert y.dtype == torch.float16
    assert_close(y, reference(x, blocks, T.Q4_K))


@pytest.mark.parametrize("ggml_type", gguf_kernels.WORD_TYPES, ids=lambda t: t.name)
def test_gemv_of_codes_read_as_words(ggml_type) -> None:
    """Rows of a multiple of 4 bytes, one or two rows of x: the GEMV decodes codes from their words
    (``_word_step``) and adds 2^e back as sums of x, within 1e-4 of a float64 product for float32
    x (the cancellation costs ~2^15 / 2^24 of a sub-block's sum); bfloat16 x read 4 columns a
    load, float16 and an x whose rows are not 8-byte aligned column by column; tilings, splits."""
    layout = LAYOUTS[ggml_type]
    unit = layout.unit_cols
    k = next(k for k in range(2 * layout.block_cols, 64 * layout.block_cols, layout.block_cols)  # rows of 16n bytes
             if k // layout.block_cols * layout.block_bytes % 16 == 0 and k >= 256)
    blocks = random_blocks(ggml_type, N, k, seed=11)
    w = device_planes(blocks, ggml_type)
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type)).double()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, k + 1, generator=g, dtype=torch.float64)
    configs = [(1, GemvConfig(block_n=64, block_k=4 * unit, splits=2, acc_2d=True)),  # 2 rows a thread
               (1, GemvConfig(block_n=64, block_k=8 * unit, splits=1, num_warps=8))]
    if ggml_type not in (T.Q4_K, T.Q6_K):
        configs += [(1, gguf_kernels.default_gemv_config(ggml_type)),
                    (2, GemvConfig(block_n=16, block_k=2 * unit, splits=3, acc_2d=False))]
    for m, config in configs:
        nu = gguf_kernels._gemv_units(config, LAYOUTS[ggml_type], k // unit)
        assert gguf_kernels.uses_words(ggml_type, m, w.shape[1], config, nu)
        exact = x[:m, :k] @ weight.T
        y = gguf_matmul(x[:m, :k].float().to(DEVICE), w, ggml_type, config=config).double().cpu()
        torch.testing.assert_close(y, exact, rtol=0, atol=1e-4 * exact.abs().max().item())
        rounded = x[:m, :k].bfloat16()
        assert_close(gguf_matmul(rounded.to(DEVICE), w, ggml_type, config=config), reference(rounded, blocks, ggml_type))
    m, config = configs[0]
    unaligned = x[:m].half().to(DEVICE)[:, 1:]  # rows start 2 bytes past 8-byte alignment: x read column by column
    assert_close(gguf_matmul(unaligned, w, ggml_type, config=config), reference(x[:m, 1:].half(), blocks, ggml_type))


def test_words_only_where_they_count_fewer_instructions() -> None:
    """``uses_words``: rows of a multiple of 16 bytes, at most two rows of x; the K-quants at one row
    of x, two or more rows of W a thread; never Q5_K."""
    default = gguf_kernels.default_gemv_config(T.Q4_0)
    assert gguf_kernels.uses_words(T.Q4_0, 2, 2304, default, 8)
    assert not gguf_kernels.uses_words(T.Q4_0, 3, 2304, default, 8)
    assert not gguf_kernels.uses_words(T.Q4_0, 1, 18 * 18, default, 8)  # 324 bytes a row
    assert not gguf_kernels.uses_words(T.Q5_K, 1, 176 * 16, GemvConfig(block_n=64, block_k=256), 4)
    for k_quant, row_bytes in ((T.Q4_K, 144 * 16), (T.Q6_K, 210 * 16)):
        assert not gguf_kernels.uses_words(k_quant, 1, row_bytes, gguf_kernels.default_gemv_config(k_quant), 4)
        assert gguf_kernels.uses_words(k_quant, 1, row_bytes, GemvConfig(block_n=64, block_k=256), 4)
        assert not gguf_kernels.uses_words(k_quant, 2, row_bytes, GemvConfig(block_n=64, block_k=256), 4)
