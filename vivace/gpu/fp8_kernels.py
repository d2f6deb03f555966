"""Triton kernels and ``torch._scaled_mm`` for FP8 weights: ``y = (x @ W^T) * scale + bias`` where
``W`` is ``float8_e4m3fn [N, K]`` and ``scale`` float32 ``[N]``, one per output channel.

- Small batches (``M <= GEMV_MAX_ROWS``, decode; K a multiple of 4, else the weight-only GEMM): a
  weight-only GEMV over W read as int32 words (four codes each), tiled by a ``kernels.GemvConfig``
  (``Fp8Linear.gemv_config``, chosen at start from ``gemv_candidates`` by graph replays; default
  ``GEMV_DEFAULT``: 8 rows of W x 1,024 columns, 8 KB a step for 4 warps). Each thread holds
  whole 16-byte chunks of x and the matching words of every row of its program, widens the codes
  with the paired hardware conversion and multiplies in float32: no reduction across threads
  until the end, one per output, where the scale is applied. The next step's weights are loaded
  before this step's arithmetic, the first before ``pdl_wait``. K is split among programs as in
  the GGUF GEMV (``gguf_kernels.gemv_splits``) so that a batch-1 step keeps every SM reading.
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

from dataclasses import replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from vivace.gpu import kernels
from vivace.gpu.gguf_kernels import gemv_splits, num_sms, store_gemv_rows
from vivace.gpu.kernels import DOT_F32, GemvConfig, e4m3_bytes, pdl_wait, round_e4m3, sum_splits

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
MIN_SCALE = 1e-12  # an all-zero row's scale, so that dividing by it stays finite
GEMV_MAX_ROWS = 8  # above it, the GEMMs
GEMV_DEFAULT = GemvConfig(block_n=8, block_k=1024, num_warps=4)
# Under Triton's interpreter (programs run one after another, in Python): the fewest programs
GEMV_INTERPRETED = GemvConfig(block_n=32, block_k=1024, num_warps=4)
GEMV_SUMS = 32  # rows of W x rows of x a GEMV program multiplies at once (registers)
GEMV_WIDENED = 64  # float32 weights a GEMV thread keeps for a chunk across several rows of x
# (rows of W a program, columns a step, warps) worth timing: 4-32 KB of weights a step, each thread
# 1-2 chunks of every row (block_k at least 32 threads x warps x 8 columns of bf16)
GEMV_TILINGS = ((8, 1024, 4), (4, 1024, 4), (16, 1024, 4), (4, 2048, 4), (8, 2048, 8), (16, 2048, 8))
GEMM_BLOCK_N, GEMM_BLOCK_K = 64, 64
QUANT_BLOCK = 1024  # columns per step of the row quantizer


@triton.jit
def _widen_e4m3(words, PTX: tl.constexpr):
    """``[..., 4 * WORDS]`` float32, in column order, of the e4m3 codes packed four to an int32,
    little-endian, in ``words [..., WORDS]`` (3D), converted by ``kernels.e4m3_bytes``."""
    b0, b1, b2, b3 = e4m3_bytes(words, tl.float32, PTX)
    columns = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [..., word, pair, byte in pair]
    return tl.reshape(columns, [words.shape[0], words.shape[1], 4 * words.shape[2]])


@triton.jit
def _gemv_kernel(W, SCALE, X, Y, BIAS, M, N, K_WORDS, words_per_split, stride_xm, stride_ym, stride_ys,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, WORDS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ACC_2D: tl.constexpr, PTX: tl.constexpr,
                 PDL: tl.constexpr):
    """One program: BLOCK_N rows of W (int32 words, four codes each) against BLOCK_M rows of x, the
    columns of one split of K in steps of CHUNKS x 4 WORDS. A thread holds the same whole chunks of
    every row, so the sums over a chunk stay in its registers until the one reduction at the end.
    The rows are loaded as one 2D tile, [rows x chunks, WORDS] (lanes along its first dimension,
    in Triton 3.6 and 3.9 alike; a [CHUNKS, ROWS, WORDS] load's lanes depend on how the version
    breaks a tie), then viewed as [CHUNKS, ROWS, WORDS]. The next step's weights are loaded before
    this step's arithmetic, the first step's before ``pdl_wait`` (no kernel writes weights).
    Split, it writes scaled float32 partial sums ``Y[split]``; else the result (+ bias) in Y's
    dtype."""
    VECTOR: tl.constexpr = 4 * WORDS
    STEP: tl.constexpr = CHUNKS * WORDS
    n0 = tl.program_id(0) * BLOCK_N
    lo = tl.program_id(1) * words_per_split
    hi = tl.minimum(lo + words_per_split, K_WORDS)
    tile = tl.arange(0, BLOCK_N * CHUNKS)
    row = tl.minimum(n0 + tile // CHUNKS, N - 1)  # rows past N repeat the last one (never stored)
    word = ((tile % CHUNKS) * WORDS)[:, None] + tl.arange(0, WORDS)[None, :]
    w_tile = (row * K_WORDS)[:, None] + word  # word offsets: int32 below 8 GiB of codes
    w = tl.load(W + (w_tile + lo), mask=lo + word < hi, other=0)
    pdl_wait(PDL)
    cols = tl.arange(0, CHUNKS)[:, None] * VECTOR + tl.arange(0, VECTOR)[None, :]
    x_rows = ()
    acc = ()
    for i in tl.static_range(BLOCK_M):
        x_rows = x_rows + (X + tl.minimum(i, M - 1) * stride_xm,)  # rows past M repeat too
        acc = acc + (tl.zeros([CHUNKS, BLOCK_N, VECTOR] if ACC_2D else [CHUNKS, BLOCK_N], tl.float32),)
    for j0 in range(lo, hi, STEP):
        w_next = tl.load(W + (w_tile + (j0 + STEP)), mask=word < hi - (j0 + STEP), other=0)
        weights = _widen_e4m3(tl.permute(tl.reshape(w, [BLOCK_N, CHUNKS, WORDS]), [1, 0, 2]), PTX)
        k = 4 * j0 + cols
        k_mask = k < 4 * hi
        summed = ()
        for i in tl.static_range(BLOCK_M):
            product = tl.load(x_rows[i] + k, mask=k_mask, other=0.0).to(tl.float32)[:, None, :] * weights
            summed = summed + (acc[i] + (product if ACC_2D else tl.sum(product, 2)),)
        acc = summed
        w = w_next
    m = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    result = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in tl.static_range(BLOCK_M):
        total = tl.sum(tl.sum(acc[i], 2), 0) if ACC_2D else tl.sum(acc[i], 0)
        result = tl.where(m[:, None] == i, total[None, :], result)
    m_mask = m < M
    n_mask = n < N
    result *= tl.load(SCALE + n, mask=n_mask, other=0.0)[None, :]
    store_gemv_rows(result, Y, BIAS, m, n, m_mask, n_mask, tl.program_id(1), stride_ym, stride_ys, HAS_BIAS, SPLIT)


@triton.jit
def _gemm_kernel(W, SCALE, X, Y, BIAS, M, N, K, stride_xm, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """One program: a [BLOCK_M, BLOCK_N] tile of Y. Axis 0 walks M, so programs reading the same
    weight rows are launched together."""
    pdl_wait(PDL)
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
def _quantize_rows_kernel(X, Q, S, K, stride_xm, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row: ``S[row] = max|x| / 448`` and ``Q[row] = x / S[row]`` in e4m3 (clamped
    first: the conversion of an out-of-range value is not saturating everywhere)."""
    pdl_wait(PDL)
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
                                    num_warps=4, **kernels.pdl(x.device))
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
               config: GemvConfig | None = None, scaled_mm: bool | None = None) -> torch.Tensor:
    """``(x @ weight^T) * scale (+ bias)``: ``x`` ``[M, K]`` float (unit stride along K), ``weight``
    ``float8_e4m3fn [N, K]`` contiguous, ``scale`` float32 ``[N]``, ``bias`` ``[N]``; returns
    ``[M, N]`` in ``x``'s dtype. ``config`` tiles the GEMV (``Fp8Linear.gemv_config``; None: the
    launcher's default); ``scaled_mm`` False takes the weight-only GEMM over ``torch._scaled_mm``
    (tests)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.dtype == FP8 and weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    assert scale.dtype == torch.float32 and scale.shape == (n,)
    if m <= GEMV_MAX_ROWS and k % 4 == 0:
        return _gemv(x, weight, scale, bias, config)
    if scaled_mm is not False and uses_scaled_mm(x, n, bias):
        codes, row_scales = quantize_rows(x)
        return torch._scaled_mm(codes, weight.t(), scale_a=row_scales, scale_b=scale.view(1, n), bias=bias,
                                out_dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = min(max(triton.next_power_of_2(m), 16), 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, GEMM_BLOCK_N))
    _gemm_kernel[grid](weight, scale, x, out, out if bias is None else bias, m, n, k, x.stride(0), out.stride(0),
                       BLOCK_M=block_m, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K, HAS_BIAS=bias is not None,
                       DOT_F32=DOT_F32, num_warps=4, **kernels.pdl(x.device))
    return out


def gemv_tiling(m: int, x_dtype: torch.dtype, config: GemvConfig) -> dict[str, int | bool]:
    """The GEMV's tile constexprs for ``m`` rows of x under ``config``, a tiling chosen at one row
    of x: a chunk is the 16 bytes of x a thread loads at once (8 columns of bf16, 4 of float32),
    so that the weights' and x's tiles take the same layout; ``config.block_k`` columns a step,
    at least a chunk for every thread; ``config.block_n`` rows of W a program, fewer where rows of
    W x rows of x would pass ``GEMV_SUMS`` or, with more rows of x than one, the widened weights
    a thread keeps for them all would pass ``GEMV_WIDENED``; ``acc_2d`` at one row of x only (its
    sums are a chunk wide). Raises ValueError for block sizes that are not powers of 2."""
    if config.block_n & (config.block_n - 1) or config.block_k & (config.block_k - 1):
        raise ValueError(f"{config}: rows and columns a step must be powers of 2")
    block_m = triton.next_power_of_2(m)
    vector = 16 // x_dtype.itemsize
    block_n = min(config.block_n, GEMV_SUMS // block_m)
    if block_m > 1:
        block_n = min(block_n, GEMV_WIDENED // vector)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, CHUNKS=max(config.block_k // vector, 32 * config.num_warps),
                WORDS=vector // 4, ACC_2D=config.acc_2d and block_m == 1)


def _gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
          config: GemvConfig | None) -> torch.Tensor:
    """``fp8_matmul`` for ``M <= GEMV_MAX_ROWS`` and K a multiple of 4, tiled by ``config``
    (default ``GEMV_DEFAULT``, ``GEMV_INTERPRETED`` under the interpreter)."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or (GEMV_INTERPRETED if kernels.INTERPRETED else GEMV_DEFAULT)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiling = gemv_tiling(m, x.dtype, config)
    step = tiling["CHUNKS"] * tiling["WORDS"]
    k_words = k // 4
    assert n * k_words < 2**31, "the GEMV's int32 word offsets"
    steps = triton.cdiv(k_words, step)
    row_programs = triton.cdiv(n, tiling["BLOCK_N"])
    splits = config.splits
    if splits is None:
        splits = gemv_splits(row_programs, steps, 1, num_sms(x.device)) if x.is_cuda else 1
    words_per_split = triton.cdiv(steps, splits) * step
    splits = triton.cdiv(k_words, words_per_split)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    has_bias = bias is not None
    bias = out if bias is None else bias
    _gemv_kernel[(row_programs, splits)](weight.view(torch.int32), scale, x, target, bias, m, n, k_words,
                                         words_per_split, x.stride(0), n, m * n, HAS_BIAS=has_bias,
                                         SPLIT=splits > 1, PTX=not kernels.INTERPRETED, num_warps=config.num_warps,
                                         **tiling, **kernels.pdl(x.device))
    if splits > 1:
        sum_splits(target, out, bias, has_bias)
    return out


def gemv_candidates(n: int, k: int, sms: int) -> list[GemvConfig]:
    """The GEMV tilings worth timing for ``W [n, k]`` at one row of x on a GPU of ``sms`` SMs,
    ``GEMV_DEFAULT`` first: each of ``GEMV_TILINGS`` no wider than K needs, with the launcher's K
    splits; ``acc_2d`` at 4 and 8 rows; the default tiling split into 1 and into about 4 and 8
    programs an SM (at least 2 steps a split) where the launcher splits otherwise. At most 11;
    on sm_90 with Triton 3.6 they take 40-164 registers a thread at one row of x, none spill."""
    widest = max(GEMV_DEFAULT.block_k, triton.next_power_of_2(k))
    candidates = [GemvConfig(block_n, block_k, None, False, warps) for block_n, block_k, warps in GEMV_TILINGS
                  if block_k <= widest]
    candidates += [replace(GEMV_DEFAULT, block_n=block_n, acc_2d=True) for block_n in (4, 8)]
    row_programs = triton.cdiv(n, GEMV_DEFAULT.block_n)
    steps = triton.cdiv(k, GEMV_DEFAULT.block_k)
    launcher_splits = gemv_splits(row_programs, steps, 1, sms)
    splits = {min(triton.cdiv(per_sm * sms, row_programs), max(1, steps // 2)) for per_sm in (4, 8)}
    candidates += [replace(GEMV_DEFAULT, splits=s) for s in sorted(splits | {1}) if s != launcher_splits]
    return candidates
