"""Triton kernels and ``torch._scaled_mm`` for FP8 weights: ``y = (x @ W^T) * scale + bias`` where
``W`` is ``float8_e4m3fn [N, K]`` and ``scale`` float32 ``[N]``, one per output channel.

- Small batches (``M <= GEMV_MAX_ROWS``, decode): a weight-only GEMV. ``GEMV_BLOCK_N`` output rows
  per program with every row of ``x``; each weight byte is read once, widened to float32 in
  registers and multiplied there; the scale is applied once per output. K is split among programs
  as in the GGUF GEMV (``gguf_kernels.gemv_splits``), so a batch-1 step keeps every SM reading.
- Larger batches with bfloat16 activations (prefill, large decode batches): FP8 tensor cores,
  through ``torch._scaled_mm`` with row-wise scales (cuBLASLt / CUTLASS): each row of ``x`` is
  quantized to e4m3 with its own scale, ``max|x| / 448``, by one Triton launch
  (``quantize_rows``), so no scale is fixed ahead of time and an outlier token costs only its
  own row's precision.
- Larger batches otherwise (float16 / float32 activations, N or K not a multiple of 16, a device
  without FP8 GEMMs): a weight-only tiled GEMM, ``tl.dot`` of ``x``'s tile and the weight tile
  widened to ``x``'s dtype (exact: every e4m3 value is a float16 and a bfloat16), float32
  accumulation.

Grids and scratch sizes depend on shapes only: CUDA-graph capturable.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from vivace.gpu import gguf_kernels
from vivace.gpu.gguf_kernels import gemv_accumulate, gemv_splits, num_sms, store_gemv_rows
from vivace.gpu.kernels import DOT_F32, round_e4m3, sum_splits

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
MIN_SCALE = 1e-12  # an all-zero row's scale, so that dividing by it stays finite
GEMV_MAX_ROWS = 8  # above it, the GEMMs
GEMV_BLOCK_N = 16  # output rows per GEMV program
GEMV_TILE = 4096  # weights x rows of x a GEMV program holds per step (registers)
GEMM_BLOCK_N, GEMM_BLOCK_K = 64, 64
QUANT_BLOCK = 1024  # columns per step of the row quantizer


@triton.jit
def _gemv_kernel(W, SCALE, X, Y, BIAS, M, N, K, k_per_split, stride_xm, stride_ym, stride_ys,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SPLIT: tl.constexpr, ACC_2D: tl.constexpr):
    """One program: BLOCK_N output rows, every row of x, the columns of one split of K. Split, it
    writes scaled float32 partial sums ``Y[split]``; else the result (+ bias) in Y's dtype."""
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    rows = W + n.to(tl.int64)[:, None] * K
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    lo = split * k_per_split
    hi = tl.minimum(lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < hi
        w = tl.load(rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        acc, acc3 = gemv_accumulate(acc, acc3, x, w, ACC_2D)
    if ACC_2D:
        acc = tl.sum(acc3, 2)
    acc *= tl.load(SCALE + n, mask=n_mask, other=0.0)[None, :]
    store_gemv_rows(acc, Y, BIAS, m, n, m_mask, n_mask, split, stride_ym, stride_ys, HAS_BIAS, SPLIT)


@triton.jit
def _gemm_kernel(W, SCALE, X, Y, BIAS, M, N, K, stride_xm, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """One program: a [BLOCK_M, BLOCK_N] tile of Y. Axis 0 walks M, so programs reading the same
    weight rows are launched together."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    x_rows = X + m.to(tl.int64)[:, None] * stride_xm
    w_rows = W + n.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(x.dtype)
        if DOT_F32:  # the interpreter's half-precision dot is wrong: same values, float32 product
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    acc *= tl.load(SCALE + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_xm, BLOCK: tl.constexpr):
    """One program per row: ``S[row] = max|x| / 448`` and ``Q[row] = x / S[row]`` in e4m3 (clamped
    first: the conversion of an out-of-range value is not saturating everywhere)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32) / scale
        x = round_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0))
        tl.store(Q + row * K + k, x.to(Q.dtype.element_ty), mask=k < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes float8_e4m3fn [M, K], scales float32 [M, 1])`` of ``x [M, K]`` (unit stride along
    K), each row scaled by ``max|row| / 448``: ``x ~= codes * scales``."""
    m, k = x.shape
    assert x.stride(1) == 1
    codes = torch.empty(m, k, dtype=FP8, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, codes, scales, k, x.stride(0), BLOCK=min(QUANT_BLOCK, triton.next_power_of_2(k)),
                                    num_warps=4)
    return codes, scales


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes float8_e4m3fn [N, K], scale float32 [N])`` of a float ``weight [N, K]``, one scale
    per output row, ``max|row| / 448``, computed where ``weight`` lives."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@lru_cache(maxsize=None)
def scaled_mm_runs(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` multiplies e4m3 with row-wise scales on ``device``: a CUDA GPU of
    compute capability 8.9 or later; elsewhere (CPU builds of torch), whether a tiny one works."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    a = torch.ones(16, 16, dtype=FP8, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def uses_scaled_mm(x: torch.Tensor, n: int, bias: torch.Tensor | None) -> bool:
    """Whether ``fp8_matmul`` multiplies ``x [M, K]`` on FP8 tensor cores (``torch._scaled_mm``)."""
    m, k = x.shape
    return (m > GEMV_MAX_ROWS and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
            and (bias is None or bias.dtype == torch.bfloat16) and scaled_mm_runs(x.device))


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               splits: int | None = None, scaled_mm: bool | None = None) -> torch.Tensor:
    """``(x @ weight^T) * scale (+ bias)``: ``x`` ``[M, K]`` float (unit stride along K), ``weight``
    ``float8_e4m3fn [N, K]`` contiguous, ``scale`` float32 ``[N]``, ``bias`` ``[N]``; returns
    ``[M, N]`` in ``x``'s dtype. ``splits`` forces the GEMV's K splits, ``scaled_mm`` False the
    weight-only GEMM over ``torch._scaled_mm`` (tests)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.dtype == FP8 and weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    assert scale.dtype == torch.float32 and scale.shape == (n,)
    if m <= GEMV_MAX_ROWS:
        return _gemv(x, weight, scale, bias, splits)
    if scaled_mm is not False and uses_scaled_mm(x, n, bias):
        codes, row_scales = quantize_rows(x)
        return torch._scaled_mm(codes, weight.t(), scale_a=row_scales, scale_b=scale.view(1, n), bias=bias,
                                out_dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = min(max(triton.next_power_of_2(m), 16), 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, GEMM_BLOCK_N))
    _gemm_kernel[grid](weight, scale, x, out, out if bias is None else bias, m, n, k, x.stride(0), out.stride(0),
                       BLOCK_M=block_m, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K, HAS_BIAS=bias is not None,
                       DOT_F32=DOT_F32, num_warps=4)
    return out


def _gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
          splits: int | None) -> torch.Tensor:
    """``fp8_matmul`` for ``M <= GEMV_MAX_ROWS``, split along K until the GPU is full."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = triton.next_power_of_2(m)
    block_k = max(32, GEMV_TILE // (GEMV_BLOCK_N * block_m))
    steps = triton.cdiv(k, block_k)
    row_programs = triton.cdiv(n, GEMV_BLOCK_N)
    if splits is None:
        splits = gemv_splits(row_programs, steps, 1, num_sms(x.device)) if x.is_cuda else 1
    k_per_split = triton.cdiv(steps, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    has_bias = bias is not None
    bias = out if bias is None else bias
    _gemv_kernel[(row_programs, splits)](weight, scale, x, target, bias, m, n, k, k_per_split, x.stride(0), n, m * n,
                                         BLOCK_M=block_m, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=block_k, HAS_BIAS=has_bias,
                                         SPLIT=splits > 1, ACC_2D=gguf_kernels.GEMV_ACC_2D, num_warps=4)
    if splits > 1:
        sum_splits(target, out, bias, has_bias)
    return out
