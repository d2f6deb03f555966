"""Triton kernels for ``y = x @ dequant(W)^T`` where ``W`` stays in device memory as a GGUF file's
blocks, bytes as they are in the file: ``uint8 [out_features, bytes_per_row]``, each output row its
own run of blocks. Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K (layouts: ggml's ``block_*`` structs, and
``gguf.quants``' reference dequantizers, against which the tests check every kernel).

The decode-path kernels read a tile of packed blocks, dequantize it in registers to float32 and
multiply it there: no float copy of a weight is written. A tile is a run of *units* of one row
(a block, or for the K-quants a quarter of a 256-wide super-block: 32 or 64 columns), decoded into
planes that are interleaved (``tl.interleave``) rather than put back in column order; the columns
of ``x`` are gathered in the same order, which costs nothing (``x`` sits in L1/L2).

- Small batches (``M <= GEMV_MAX_ROWS``, decode): a GEMV, ``GEMV_BLOCK_N`` output rows per program
  with every row of ``x``, K in tiles, float32 multiply-add; K is split among programs (partial
  sums in float32, added by a second small kernel) when the rows alone give too few programs to
  fill the GPU (a 4096-row down projection at batch 1 gives 256).
- Decode batches (``M <= GEMM_MAX_ROWS``): a tiled GEMM, ``tl.dot`` of ``x``'s tile and the
  dequantized weight tile rounded to ``x``'s dtype, float32 accumulation; one row tile of ``x``,
  so each weight tile is decoded once.
- Prefill (more rows): the weight dequantized into ``x``'s dtype by ``_dequantize_kernel``, in
  slices of at most ``DEQUANT_SLICE_BYTES``, then cuBLAS (llama.cpp's way for large batches). The
  tiled GEMM decoded each weight tile once per 64 rows and ran at ~22 TFLOP/s on an H200: the
  dequantizing pass writes and reads 2 bytes a weight, which a 512-row product repays many times.

Activations are read in their dtype (bf16, fp16, fp32), results written in it. Grids and
scratch sizes depend on shapes only, never on values: CUDA-graph capturable. Only Triton API of
both 3.6 and 3.9 is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import gguf
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vivace.gpu.kernels import DOT_F32, sum_splits

T = gguf.GGMLQuantizationType
GEMV_MAX_ROWS = 8  # above it, the tensor-core GEMM
# Above this many rows, the weight is dequantized to x's dtype once, in slices of at most
# DEQUANT_SLICE_BYTES, and multiplied by cuBLAS (llama.cpp's way for large batches). The fused GEMM
# decodes each weight tile once per 64 rows of x: on an H200 (Triton 3.6) it ran at ~22 TFLOP/s, so
# a 512-token prefill of the 8B shape in Q4_0 took 320 ms against 23 ms in bf16 (docs/benchmarks.md).
# Up to 64 rows the GEMM decodes each tile once, as a dequantizing pass would, and keeps its bytes.
GEMM_MAX_ROWS = 64
DEQUANT_SLICE_BYTES = 256 << 20
DEQUANT_BLOCK_N = 64
GEMV_BLOCK_N = 16  # output rows per GEMV program
GEMV_TILE = 4096  # weights x rows of x a GEMV program holds per step (registers)
GEMM_BLOCK_N, GEMM_BLOCK_K = 64, 128
PROGRAMS_PER_SM = 8  # split K until the GEMV has about this many programs per SM
# The GEMVs (this one, the FP8 one) sum each tile's products over K inside the loop, a cross-thread
# reduction per step; ACC_2D keeps a [rows of x, BLOCK_N, BLOCK_K] accumulator and reduces once at
# the end (registers as the tile's). Unmeasured on a GPU: VIVACE_GEMV_ACC_2D=1 turns it on, so that
# benchmarks/gpu.py can time both in one device call; the default follows what it shows.
GEMV_ACC_2D = os.environ.get("VIVACE_GEMV_ACC_2D") == "1"


@dataclass(frozen=True)
class BlockLayout:
    """One GGUF type's block: ``block_bytes`` bytes hold ``block_cols`` weights, decoded in
    ``units_per_block`` units (the kernels' step along K)."""

    block_bytes: int
    block_cols: int
    units_per_block: int

    @property
    def unit_cols(self) -> int:
        return self.block_cols // self.units_per_block


LAYOUTS = {
    T.Q8_0: BlockLayout(34, 32, 1),  # f16 d, int8 qs[32]
    T.Q4_0: BlockLayout(18, 32, 1),  # f16 d, qs[16]: element j low nibble, j + 16 high
    T.Q4_1: BlockLayout(20, 32, 1),  # f16 d, f16 m, qs[16]
    T.Q4_K: BlockLayout(144, 256, 4),  # f16 d, f16 dmin, scales[12], qs[128]
    T.Q5_K: BlockLayout(176, 256, 4),  # f16 d, f16 dmin, scales[12], qh[32], qs[128]
    T.Q6_K: BlockLayout(210, 256, 4),  # ql[128], qh[64], int8 scales[16], f16 d
}
GPU_TYPES = tuple(LAYOUTS)


# --- decoding a tile of blocks ---------------------------------------------------------------
# Each decoder takes ``row`` (pointers to the tile's rows, [BLOCK_N, 1]), ``u`` (unit indices along
# the row, [NU]) and ``mask`` ([BLOCK_N, NU]); it returns weights [BLOCK_N, NU, unit_cols] in
# float32 (zero where masked) and their columns [NU, unit_cols], in the same (plane) order.


@triton.jit
def _f16(ptr, mask):
    """float32 value of the little-endian float16 at each (byte) pointer."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q8_0_tile(row, u, mask):
    block = row + u[None, :] * 34
    j = tl.arange(0, 32)
    q = tl.load(block[:, :, None] + 2 + j[None, None, :], mask=mask[:, :, None], other=0)
    w = q.to(tl.int8, bitcast=True).to(tl.float32) * _f16(block, mask)[:, :, None]
    return w, u[:, None] * 32 + j[None, :]


@triton.jit
def _q4_tile(row, u, mask, BLOCK_BYTES: tl.constexpr, HAS_MIN: tl.constexpr):
    """Q4_0 (``d * (q - 8)``) and Q4_1 (``d * q + m``): the low nibbles, then the high ones."""
    block = row + u[None, :] * BLOCK_BYTES
    d = _f16(block, mask)[:, :, None]
    j = tl.arange(0, 16)
    packed = tl.load(block[:, :, None] + (BLOCK_BYTES - 16) + j[None, None, :], mask=mask[:, :, None], other=0)
    lo = (packed & 15).to(tl.float32)
    hi = (packed >> 4).to(tl.float32)
    if HAS_MIN:
        m = _f16(block + 2, mask)[:, :, None]
        lo = lo * d + m
        hi = hi * d + m
    else:
        lo = (lo - 8.0) * d
        hi = (hi - 8.0) * d
    cols = u[:, None] * 32 + j[None, :]
    return tl.interleave(lo, hi), tl.interleave(cols, cols + 16)


@triton.jit
def _k_scale_min(scales, s, mask):
    """Q4_K/Q5_K: the six-bit scale and min of sub-block ``s`` (0-7) from the 12 bytes at ``scales``
    (s < 4: low six bits of bytes s and s + 4; else: nibbles of byte s + 4, top bits of s - 4 and s)."""
    a = tl.load(scales + s, mask=mask, other=0)
    b = tl.load(scales + s + 4, mask=mask, other=0)
    c = tl.load(scales + (s & 3), mask=mask, other=0)
    low = s < 4
    scale = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
    minimum = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _k4_tile(row, u, mask, BLOCK_BYTES: tl.constexpr, QS: tl.constexpr, FIVE_BITS: tl.constexpr):
    """Q4_K/Q5_K, ``d * scale * q - dmin * min`` per 32-wide sub-block. Unit = 32 bytes of ``qs``:
    sub-block 2i in the low nibbles, 2i + 1 in the high ones; Q5_K's fifth bit of column j of
    sub-block s is bit s of ``qh[j]``."""
    chunk = u % 4
    block = row + (u // 4 * BLOCK_BYTES)[None, :]
    d = _f16(block, mask)
    dmin = _f16(block + 2, mask)
    s = (2 * chunk)[None, :]
    scale_lo, min_lo = _k_scale_min(block + 4, s, mask)
    scale_hi, min_hi = _k_scale_min(block + 4, s + 1, mask)
    j = tl.arange(0, 32)
    mask3 = mask[:, :, None]
    packed = tl.load(block[:, :, None] + QS + (chunk * 32)[None, :, None] + j[None, None, :], mask=mask3, other=0)
    lo = (packed & 15).to(tl.int32)
    hi = (packed >> 4).to(tl.int32)
    if FIVE_BITS:
        qh = tl.load(block[:, :, None] + 16 + j[None, None, :], mask=mask3, other=0).to(tl.int32)
        shift = s[:, :, None]
        lo = lo | (((qh >> shift) & 1) << 4)
        hi = hi | (((qh >> (shift + 1)) & 1) << 4)
    lo = lo.to(tl.float32) * (d * scale_lo)[:, :, None] - (dmin * min_lo)[:, :, None]
    hi = hi.to(tl.float32) * (d * scale_hi)[:, :, None] - (dmin * min_hi)[:, :, None]
    cols = (u // 4 * 256 + chunk * 64)[:, None] + j[None, :]
    return tl.interleave(lo, hi), tl.interleave(cols, cols + 32)


@triton.jit
def _q6_k_run(low, high, scale, d, mask):
    """One run of 16 Q6_K weights: ``d * scale * (low | high << 4) - 32``."""
    s = tl.load(scale, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return ((low | (high << 4)).to(tl.int32) - 32).to(tl.float32) * (d * s)[:, :, None]


@triton.jit
def _q6_k_tile(row, u, mask):
    """Q6_K. Column ``h * 128 + r * 32 + j`` (half h, run r): low four bits in ``ql[h * 64 +
    (r % 2) * 32 + j]`` (low nibble for r < 2, high for r >= 2), top two in bits 2r of
    ``qh[h * 32 + j]``, scale ``scales[h * 8 + 2r + j // 16]``. Unit = (h, j // 16): 4 runs of 16."""
    half = u // 2 % 2
    quarter = u % 2
    block = row + (u // 4 * 210)[None, :]
    d = _f16(block + 208, mask)
    i = tl.arange(0, 16)
    mask3 = mask[:, :, None]
    at = (half * 64 + quarter * 16)[None, :, None] + i[None, None, :]
    ql_a = tl.load(block[:, :, None] + at, mask=mask3, other=0)
    ql_b = tl.load(block[:, :, None] + at + 32, mask=mask3, other=0)
    qh = tl.load(block[:, :, None] + 128 + (half * 32 + quarter * 16)[None, :, None] + i[None, None, :], mask=mask3,
                 other=0)
    scale = block + 192 + (half * 8 + quarter)[None, :]
    w0 = _q6_k_run(ql_a & 15, qh & 3, scale, d, mask)
    w1 = _q6_k_run(ql_b & 15, (qh >> 2) & 3, scale + 2, d, mask)
    w2 = _q6_k_run(ql_a >> 4, (qh >> 4) & 3, scale + 4, d, mask)
    w3 = _q6_k_run(ql_b >> 4, qh >> 6, scale + 6, d, mask)
    cols = (u // 4 * 256 + half * 128 + quarter * 16)[:, None] + i[None, :]
    return (tl.interleave(tl.interleave(w0, w1), tl.interleave(w2, w3)),
            tl.interleave(tl.interleave(cols, cols + 32), tl.interleave(cols + 64, cols + 96)))


@triton.jit
def _dequant_tile(row, u, mask, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights [BLOCK_N, BLOCK_K] (float32) of units ``u`` of the rows at ``row``, and their columns
    [BLOCK_K]. FORMAT is the ggml type's number."""
    if FORMAT == 8:
        w, cols = _q8_0_tile(row, u, mask)
    elif FORMAT == 2:
        w, cols = _q4_tile(row, u, mask, 18, False)
    elif FORMAT == 3:
        w, cols = _q4_tile(row, u, mask, 20, True)
    elif FORMAT == 12:
        w, cols = _k4_tile(row, u, mask, 144, 16, False)
    elif FORMAT == 13:
        w, cols = _k4_tile(row, u, mask, 176, 48, True)
    else:
        tl.static_assert(FORMAT == 14, "unsupported GGUF type")
        w, cols = _q6_k_tile(row, u, mask)
    return tl.reshape(w, [BLOCK_N, BLOCK_K]), tl.reshape(cols, [BLOCK_K])


# --- the matmuls -----------------------------------------------------------------------------


@triton.jit
def _dequantize_kernel(W, OUT, N, K, row_bytes, units, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
                       NU: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: rows [BLOCK_N] x units [NU] of the blocks at W, decoded into OUT ``[N, K]`` (OUT's
    dtype, row-major)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    u = tl.program_id(1) * NU + tl.arange(0, NU)
    w, cols = _dequant_tile(W + n.to(tl.int64)[:, None] * row_bytes, u, n_mask[:, None] & (u < units)[None, :],
                            FORMAT, BLOCK_N, BLOCK_K)
    tl.store(OUT + n.to(tl.int64)[:, None] * K + cols[None, :], w.to(OUT.dtype.element_ty),
             mask=n_mask[:, None] & (cols < K)[None, :])


@triton.jit
def _gemv_kernel(W, X, Y, BIAS, M, N, K, row_bytes, units, units_per_split, stride_xm, stride_ym, stride_ys,
                 FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NU: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ACC_2D: tl.constexpr):
    """One program: BLOCK_N output rows, every row of x, the units of one split of K. Split, it
    writes float32 partial sums ``Y[split]``; else the result (+ bias) in Y's dtype."""
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    row = W + n.to(tl.int64)[:, None] * row_bytes
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    lo = split * units_per_split
    hi = tl.minimum(lo + units_per_split, units)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for u0 in range(lo, hi, NU):
        u = u0 + tl.arange(0, NU)
        w, cols = _dequant_tile(row, u, n_mask[:, None] & (u < hi)[None, :], FORMAT, BLOCK_N, BLOCK_K)
        x = tl.load(X + m[:, None] * stride_xm + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :],
                    other=0.0).to(tl.float32)
        acc, acc3 = gemv_accumulate(acc, acc3, x, w, ACC_2D)
    if ACC_2D:
        acc = tl.sum(acc3, 2)
    store_gemv_rows(acc, Y, BIAS, m, n, m_mask, n_mask, split, stride_ym, stride_ys, HAS_BIAS, SPLIT)


@triton.jit
def gemv_accumulate(acc, acc3, x, w, ACC_2D: tl.constexpr):
    """One K tile of a GEMV: ``x [rows of x, BLOCK_K]`` times ``w [BLOCK_N, BLOCK_K]`` (float32),
    summed over K into ``acc`` now, or (ACC_2D) added into ``acc3`` for one sum at the end."""
    if ACC_2D:
        acc3 += x[:, None, :] * w[None, :, :]
    else:
        acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
    return acc, acc3


@triton.jit
def store_gemv_rows(acc, Y, BIAS, m, n, m_mask, n_mask, split, stride_ym, stride_ys, HAS_BIAS: tl.constexpr,
                    SPLIT: tl.constexpr):
    """A GEMV program's float32 ``acc [rows of x, rows of W]``: split, the partial sums ``Y[split]``
    (``kernels.sum_splits`` adds them and the bias); else the result (+ bias) in Y's dtype."""
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(Y + split * stride_ys + m[:, None] * stride_ym + n[None, :], acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit
def _gemm_kernel(W, X, Y, BIAS, M, N, K, row_bytes, units, stride_xm, stride_ym,
                 FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NU: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr):
    """One program: a [BLOCK_M, BLOCK_N] tile of Y. Axis 0 walks M, so programs reading the same
    weight rows are launched together."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    row = W + n.to(tl.int64)[:, None] * row_bytes
    x_rows = X + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for u0 in range(0, units, NU):
        u = u0 + tl.arange(0, NU)
        w, cols = _dequant_tile(row, u, n_mask[:, None] & (u < units)[None, :], FORMAT, BLOCK_N, BLOCK_K)
        x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :], other=0.0)
        w = w.to(x.dtype)
        if DOT_F32:  # the interpreter's half-precision dot is wrong: same rounding, float32 product
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off the GPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def gemv_splits(row_programs: int, units: int, units_per_step: int, num_sms: int) -> int:
    """K splits for a GEMV of ``row_programs`` programs per split: about PROGRAMS_PER_SM programs
    per SM in all, no split shorter than 4 steps."""
    want = -(-PROGRAMS_PER_SM * num_sms // row_programs)
    return max(1, min(want, units // (4 * units_per_step)))


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: T, bias: torch.Tensor | None = None,
                splits: int | None = None) -> torch.Tensor:
    """``x @ dequant(blocks)^T (+ bias)``: ``x`` ``[M, K]`` float (unit stride along K), ``blocks``
    ``uint8 [N, K / block_cols * block_bytes]`` of ``ggml_type`` (one of ``GPU_TYPES``), ``bias``
    ``[N]``; returns ``[M, N]`` in ``x``'s dtype. ``splits`` forces the GEMV's K splits (tests)."""
    layout = LAYOUTS[ggml_type]
    m, k = x.shape
    n, row_bytes = blocks.shape
    assert blocks.dtype == torch.uint8 and blocks.stride(1) == 1 and x.stride(1) == 1
    assert k % layout.block_cols == 0 and row_bytes == k // layout.block_cols * layout.block_bytes, \
        f"{ggml_type.name} blocks {tuple(blocks.shape)} do not hold {k} columns"
    if m > GEMM_MAX_ROWS:
        return _dequantized_matmul(x, blocks, ggml_type, bias)
    units = k // layout.unit_cols
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    bias = out if bias is None else bias
    if m > GEMV_MAX_ROWS:
        block_m = min(max(triton.next_power_of_2(m), 16), 64)
        nu = max(1, GEMM_BLOCK_K // layout.unit_cols)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, GEMM_BLOCK_N))
        _gemm_kernel[grid](blocks, x, out, bias, m, n, k, row_bytes, units, x.stride(0), out.stride(0),
                           FORMAT=int(ggml_type), BLOCK_M=block_m, BLOCK_N=GEMM_BLOCK_N, NU=nu,
                           BLOCK_K=nu * layout.unit_cols, HAS_BIAS=has_bias, DOT_F32=DOT_F32, num_warps=8)
        return out
    block_m = triton.next_power_of_2(m)
    nu = max(1, GEMV_TILE // (GEMV_BLOCK_N * block_m * layout.unit_cols))
    row_programs = triton.cdiv(n, GEMV_BLOCK_N)
    if splits is None:
        splits = gemv_splits(row_programs, units, nu, num_sms(x.device)) if x.is_cuda else 1
    units_per_split = triton.cdiv(triton.cdiv(units, splits), nu) * nu
    splits = triton.cdiv(units, units_per_split)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[(row_programs, splits)](blocks, x, target, bias, m, n, k, row_bytes, units, units_per_split,
                                         x.stride(0), n, m * n, FORMAT=int(ggml_type), BLOCK_M=block_m,
                                         BLOCK_N=GEMV_BLOCK_N, NU=nu, BLOCK_K=nu * layout.unit_cols,
                                         HAS_BIAS=has_bias, SPLIT=splits > 1, ACC_2D=GEMV_ACC_2D, num_warps=4)
    if splits > 1:
        sum_splits(target, out, bias, has_bias)
    return out


def _dequantized_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: T, bias: torch.Tensor | None
                        ) -> torch.Tensor:
    """``gguf_matmul`` for many rows: the weight dequantized into ``x``'s dtype a slice of rows
    (at most ``DEQUANT_SLICE_BYTES``) at a time, each slice multiplied by cuBLAS."""
    m, k = x.shape
    n = blocks.shape[0]
    rows = max(DEQUANT_BLOCK_N, DEQUANT_SLICE_BYTES // (k * x.element_size()) // DEQUANT_BLOCK_N * DEQUANT_BLOCK_N)
    if bias is not None:
        bias = bias.to(x.dtype)
    if rows >= n:
        return F.linear(x, dequantize(blocks, ggml_type, k, x.dtype), bias)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    for start in range(0, n, rows):
        out[:, start:start + rows] = F.linear(x, dequantize(blocks[start:start + rows], ggml_type, k, x.dtype),
                                              None if bias is None else bias[start:start + rows])
    return out


def dequantize(blocks: torch.Tensor, ggml_type: T, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, k]`` weights in ``dtype`` of ``blocks`` (``uint8 [N, row bytes]`` of ``ggml_type``)."""
    layout = LAYOUTS[ggml_type]
    n, row_bytes = blocks.shape
    units = k // layout.unit_cols
    nu = max(1, GEMM_BLOCK_K // layout.unit_cols)
    out = torch.empty(n, k, dtype=dtype, device=blocks.device)
    grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(units, nu))
    _dequantize_kernel[grid](blocks, out, n, k, row_bytes, units, FORMAT=int(ggml_type), BLOCK_N=DEQUANT_BLOCK_N,
                             NU=nu, BLOCK_K=nu * layout.unit_cols, num_warps=4)
    return out
