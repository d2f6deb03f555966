"""Triton kernels of the CUDA backend, each with a launcher that takes torch tensors.

Paged KV layout, as everywhere in vivace: per layer ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (0 keys, 1 values); a token's slot is ``block * block_size + offset``; a sequence's
block table lists its blocks in order. Only API present in Triton 3.6 is used. Every kernel
accumulates in float32 and rounds where the Hugging Face formulation rounds, so float32 inputs
give float32 results equal to the torch reference up to summation order.

A float8 (e4m3) cache comes with its scales, float32 ``[2, num_kv_heads]`` per layer (keys', then
values'): a stored value is the real one divided by its head's scale (``vivace.gpu.kv_fp8``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

NO_WINDOW = 1 << 30  # a window no sequence reaches
# Triton's interpreter multiplies bfloat16/float16 blocks wrongly in tl.dot (3.9: garbage): under
# it the attention kernels round their operands as on the GPU, then multiply in float32.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
DOT_F32 = INTERPRETED
LOG2E = 1.4426950408889634
FP8_KV = torch.float8_e4m3fn
E4M3_MAX = tl.constexpr(448.0)  # e4m3's largest finite value: the write clamps to it, never NaN


# Programmatic dependent launch (compute capability 9.0 and later): a kernel launched with it may
# start while the kernel before it in the stream or CUDA graph is still running; it lets the next
# one start too, then waits (``pdl_wait``, griddepcontrol) until the kernels before it are done and
# their writes are seen, before it reads or writes anything they touch. What a kernel does before
# the wait (its programs placed on the SMs, address arithmetic) overlaps the previous kernel's
# tail: the batch-1 decode step is ~10 short kernels a layer, each paying that ramp. On by default
# (VIVACE_PDL=0 or ``set_pdl(False)`` turns it off): on an H200 it was the fastest launch variant of
# every batch-1 graph timed (1-21%), and the exactness suite passed with it; never under the
# interpreter. The
# FP8 and GGUF GEMVs load their first weight tile before the wait: weights must not be written by
# the kernel launched just before them on the stream (true once a model is loaded; a benchmark that
# builds weights and multiplies at once under PDL should synchronize between).
_PDL = os.environ.get("VIVACE_PDL", "1") != "0"


def set_pdl(enabled: bool) -> bool:
    """Turn programmatic dependent launch on or off for launches from now on (graphs captured
    before keep what they captured); returns the setting it replaces."""
    global _PDL
    before, _PDL = _PDL, enabled
    return before


def pdl(device: torch.device) -> dict:
    """Launch keywords of a kernel that takes part in programmatic dependent launch (its ``PDL``
    constexpr, and ``launch_pdl`` when on): on where enabled, on a GPU of compute capability 9.0+."""
    on = _PDL and not INTERPRETED and device.type == "cuda" and _capability(device) >= (9, 0)
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


@lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A kernel's first step under programmatic dependent launch: let the next kernel launch (its
    programs wait in their own ``pdl_wait``), then wait for the kernels before this one. Nothing
    without PDL."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@dataclass(frozen=True)
class GemvConfig:
    """How a weight-only GEMV (FP8, GGUF: up to 8 rows of x) tiles its product: ``block_n``
    output rows a program, ``block_k`` columns of K a loop step, ``splits`` programs along K
    (None: the launcher's own choice from the GPU's size), ``acc_2d`` one reduction over K at the
    end instead of one a step, ``num_warps``. A module's ``gemv_config`` (set at start by
    ``forward.choose_gemv`` from timed candidates) overrides the launcher's defaults."""

    block_n: int
    block_k: int
    splits: int | None = None
    acc_2d: bool = False
    num_warps: int = 4


def _pow2(n: int, least: int = 1) -> int:
    return max(triton.next_power_of_2(n), least)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# Of the 227 KiB of shared memory an H100 block may use, what the pipelined K/V tiles may take
# (the rest: the query tile and Triton's layout conversions).
KV_TILES_SMEM = 160 * 1024


def attention_launch(rows: int, block_d: int, block_n: int, itemsize: int) -> dict[str, int]:
    """``num_warps`` and ``num_stages`` of an attention program over a ``[rows, block_d]`` query
    tile and ``[block_n, block_d]`` K/V tiles whose ``tl.dot`` operands take ``itemsize`` bytes:
    warps enough that the float32 accumulator holds at most 64 registers a thread (4 to 8), K/V
    tiles pipelined up to 3 deep while they fit in ``KV_TILES_SMEM`` (float32 tiles of head_dim
    256 fit once). Raises AssertionError for tiles a GPU's ``tl.dot`` rejects: every dimension a
    power of two and at least 16 (Triton's interpreter checks neither)."""
    assert all(_is_pow2(n) and n >= 16 for n in (rows, block_d, block_n)), (rows, block_d, block_n)
    num_warps = min(max(rows * block_d // (32 * 64), 4), 8)
    num_stages = max(1, min(3, KV_TILES_SMEM // (2 * block_n * block_d * itemsize)))
    return dict(num_warps=num_warps, num_stages=num_stages)


def _reads_words(fp8: bool, q: torch.Tensor, head_dim: int) -> bool:
    """Whether attention reads a float8 cache as int32 words into float16 tiles (``_e4m3_tile``):
    for 16-bit queries, where each half of a head is whole words."""
    return fp8 and q.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0


def _dot_f32(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether attention multiplies in float32: under the interpreter, and where the queries and
    the cache differ in dtype (``tl.dot`` takes operands of one dtype). A float8 cache's tiles are
    converted to the queries' dtype, exactly (e4m3 values are bfloat16, float16 and float32 values)."""
    return DOT_F32 or (q.dtype != kv_cache.dtype and kv_cache.dtype != FP8_KV)


def _dot_itemsize(q: torch.Tensor, kv_cache: torch.Tensor) -> int:
    return 4 if _dot_f32(q, kv_cache) else q.dtype.itemsize


def _kv_fp8(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """Whether ``kv_cache`` is float8; asserts that it comes with its ``[2, num_kv_heads]`` float32
    scales, and only it."""
    fp8 = kv_cache.dtype == FP8_KV
    assert fp8 == (kv_scale is not None), "a float8 KV cache needs its scales, and only a float8 one"
    assert not fp8 or (kv_scale.dtype == torch.float32 and kv_scale.shape == (2, kv_cache.shape[3])
                       and kv_scale.is_contiguous()), kv_scale
    return fp8


# --- attention ------------------------------------------------------------------------------


@triton.jit
def _paged_offsets(TABLE, n, n_mask, kvh, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr):
    """Offsets ``[len(n)]`` (int64) in a layer's cache of the keys of positions ``n`` of the sequence
    whose block table starts at ``TABLE``, KV head ``kvh`` (values: ``stride_kv`` further)."""
    page = tl.load(TABLE + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    return page * stride_cb + (n % BLOCK_SIZE) * stride_cs + kvh * stride_ch


@triton.jit
def _paged_kv_tile(CACHE, TABLE, n, n_mask, d, d_mask, kvh, stride_kv, stride_cb, stride_cs, stride_ch,
                   BLOCK_SIZE: tl.constexpr):
    """Keys and values ``[len(n), len(d)]`` of positions ``n`` of the sequence whose block table
    starts at ``TABLE``, KV head ``kvh`` (zeros where masked)."""
    offs = _paged_offsets(TABLE, n, n_mask, kvh, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(CACHE + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(CACHE + stride_kv + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _head_scales(KV_SCALE, kvh, stride_sk, scale_log2, KV_FP8: tl.constexpr):
    """``(scores' factor, output's factor)`` of KV head ``kvh``. A float8 tile enters ``tl.dot`` as
    stored (converted exactly), so its head's key scale joins the softmax scale and its value scale
    multiplies the output: one multiply a program instead of one an element, and no rounding of
    ``value * scale`` to the queries' dtype."""
    v_scale = 1.0
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(KV_SCALE + kvh)
        v_scale = tl.load(KV_SCALE + stride_sk + kvh)
    return scale_log2, v_scale


@triton.jit
def _scores(q, k, DOT_F32: tl.constexpr):
    """``q @ k^T`` in float32 (``tl.dot`` of the tiles as stored, or of their float32 values)."""
    if DOT_F32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    return s


@triton.jit
def _online_softmax_step(q, k, v, visible, m, l, acc, scale_log2, DOT_F32: tl.constexpr):
    """Flash attention's update of the running max ``m``, sum ``l`` and output ``acc`` of the
    queries ``q`` by one tile of keys/values, where ``visible`` says which query sees which key."""
    return _softmax_update(_scores(q, k, DOT_F32), v, visible, m, l, acc, scale_log2, DOT_F32)


@triton.jit
def _softmax_update(s, v, visible, m, l, acc, scale_log2, DOT_F32: tl.constexpr):
    """``_online_softmax_step`` from the tile's raw scores ``s``."""
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_sub[:, None])
    alpha = tl.exp2(m - m_sub)
    l = l * alpha + tl.sum(p, 1)
    if DOT_F32:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def _rotated_heads(ROW, heads, h_mask, i, i_mask, cos, sin, NORM_W, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                   QK_NORM: tl.constexpr):
    """Heads ``heads`` of the q/k/v row at ROW as ``rotary_kv_write`` computes them, as halves
    ``[len(heads), BLOCK_HALF]`` in float32: (QK_NORM: each head RMS-normed with NORM_W, rounded
    as ``rotary_kv_write`` does,) then rotated by ``cos``, ``sin`` (``[BLOCK_HALF]``)."""
    mask = h_mask[:, None] & i_mask[None, :]
    src = ROW + heads[:, None] * HEAD_DIM + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = _head_rms_norm(x1, x2, tl.load(NORM_W + i, mask=i_mask, other=0.0).to(tl.float32),
                                tl.load(NORM_W + HALF + i, mask=i_mask, other=0.0).to(tl.float32), eps, HEAD_DIM,
                                ROW.dtype.element_ty)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _float16(x):
    """``x`` in float16, clamped to its range: a bfloat16 value within it is a float16 value."""
    return tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def e4m3_bytes(words, dtype: tl.constexpr, PTX: tl.constexpr):
    """The four e4m3 codes of each int32 of ``words`` (little-endian), exactly, in ``dtype``. PTX:
    two paired conversions to float16 a word (``cvt.rn.f16x2.e4m3x2``) on the registers as loaded
    (Triton's own cast unpacks the bytes and pairs them again, or reads a tile from shared memory a
    byte at a time), then to ``dtype``; else, under the interpreter, Triton's casts."""
    if PTX:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi;
            .reg .b32 p01, p23;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p01, lo;
            cvt.rn.f16x2.e4m3x2 p23, hi;
            mov.b32 {$0, $1}, p01;
            mov.b32 {$2, $3}, p23;
            }""", "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
            pack=1)
        return b0.to(dtype), b1.to(dtype), b2.to(dtype), b3.to(dtype)
    return (words.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype),
            (words >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype),
            (words >> 16).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype),
            (words >> 24).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype))


@triton.jit
def _e4m3_tile(WORDS, rows, w, mask, PTX: tl.constexpr):
    """``[len(rows), 4 * len(w)]`` float16: the e4m3 codes of words ``w`` of the rows starting at
    word ``rows`` of WORDS (int32, four codes a word, little-endian), exactly (every e4m3 value is
    a float16 value); zeros where ``mask`` is off (``e4m3_bytes``: Triton's cast of a float8 tile to
    bfloat16 read the tile from shared memory a byte at a time and converted each value twice,
    ~7 instructions a byte of cache in the decode loop on sm_90, against ~2 for a bfloat16 cache)."""
    words = tl.load(WORDS + rows[:, None] + w[None, :], mask=mask, other=0)
    b0, b1, b2, b3 = e4m3_bytes(words, tl.float16, PTX)
    columns = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [row, word, pair, byte in pair]
    return tl.reshape(columns, [words.shape[0], 4 * words.shape[1]])


@triton.jit
def _decode_attention_kernel(
    Q, CACHE, WORDS, KV_SCALE, BLOCK_TABLES, SEQ_LENS, QUERY_START, OUT, M_OUT, L_OUT, COS, SIN, POSITIONS, SLOTS,
    Q_NORM, K_NORM,
    scale_log2, window, eps,
    stride_qb, stride_qh, stride_kv, stride_cb, stride_cs, stride_ch, stride_sk, stride_bt,
    stride_ob, stride_oh, stride_os, stride_mb, stride_mh, stride_cos,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, KV_FP8: tl.constexpr, ROPE: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, QK_NORM: tl.constexpr, MIXED: tl.constexpr,
    KV_WORDS: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
):
    """One program: one sequence, one KV head with its GROUP query heads, one split of the keys.
    Queries and keys are multiplied as halves (``[.., :HALF]`` and ``[.., HALF:]``, two dots),
    the halves a rotation pairs. ROPE: Q is the q/k/v projection's rows and this kernel does
    ``rotary_kv_write``'s work too: it rotates the query heads itself (every split), and the split
    that holds the new token (position ``seq_len - 1``) rotates its key, stores key and value at
    the token's slot, and attends it from registers, as stored: no program reads that slot, so
    no write and read of one address meet within the launch. MIXED: the decode rows of a prompt
    step, sequence b's query and output are row ``query_start[b]`` of Q and OUT, and a sequence
    with other than one query is left to the prefill kernel (its programs scan and store nothing).
    KV_WORDS: a float8 cache read as int32 words (WORDS, the cache's memory) and multiplied as
    float16, the queries too (``_e4m3_tile``)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    scale_log2, v_scale = _head_scales(KV_SCALE, kvh, stride_sk, scale_log2, KV_FP8)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    q_row = b
    if MIXED:
        q_row, single = _single_query_row(QUERY_START, b)
        seq_len = tl.where(single, seq_len, 0)
    start = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, BLOCK_HALF)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    if MIXED:  # every load of Q and store of this program masked: another sequence's row may be past Q
        g_mask = g < tl.where(single, GROUP, 0)  # not ``& single``: the interpreter's mask would be int
    i_mask = i < HALF
    d_mask = d < HEAD_DIM
    if ROPE:
        row = Q + b.to(tl.int64) * stride_qb
        pos = tl.load(POSITIONS + b).to(tl.int64)
        cos = tl.load(COS + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)
        sin = tl.load(SIN + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)
        q1, q2 = _rotated_heads(row, heads, g_mask, i, i_mask, cos, sin, Q_NORM, eps, HEAD_DIM, HALF, QK_NORM)
        q1, q2 = q1.to(Q.dtype.element_ty), q2.to(Q.dtype.element_ty)  # as the rotary kernel stores q
        cached = hi - (lo <= seq_len - 1).to(tl.int32) * (seq_len - 1 < hi).to(tl.int32)  # the new token aside
    else:
        q_rows = Q + q_row * stride_qb + heads[:, None] * stride_qh + i[None, :]
        q_mask = g_mask[:, None] & i_mask[None, :]
        q1 = tl.load(q_rows, mask=q_mask, other=0.0)
        q2 = tl.load(q_rows + HALF, mask=q_mask, other=0.0)
        cached = hi
    if KV_WORDS:
        q1, q2 = _float16(q1), _float16(q2)
        w_half = tl.arange(0, BLOCK_HALF // 4)
        w_head = tl.arange(0, BLOCK_D // 4)
        w_half_mask, w_head_mask = w_half < HALF // 4, w_head < HEAD_DIM // 4
        v_words = stride_kv // 4

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = BLOCK_TABLES + b * stride_bt
    for n0 in range(lo, cached, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < cached
        offsets = _paged_offsets(table, n, n_mask, kvh, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        if KV_WORDS:
            rows = offsets >> 2
            k_mask = n_mask[:, None] & w_half_mask[None, :]
            k1 = _e4m3_tile(WORDS, rows, w_half, k_mask, PTX)
            k2 = _e4m3_tile(WORDS, rows + HALF // 4, w_half, k_mask, PTX)
            v = _e4m3_tile(WORDS, rows + v_words, w_head, n_mask[:, None] & w_head_mask[None, :], PTX)
        else:
            keys = CACHE + offsets[:, None]
            k_mask = n_mask[:, None] & i_mask[None, :]
            k1 = tl.load(keys + i[None, :], mask=k_mask, other=0.0)
            k2 = tl.load(keys + HALF + i[None, :], mask=k_mask, other=0.0)
            v = tl.load(keys + stride_kv + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            if KV_FP8:
                k1, k2, v = k1.to(q1.dtype), k2.to(q1.dtype), v.to(q1.dtype)
        s = _scores(q1, k1, DOT_F32) + _scores(q2, k2, DOT_F32)
        m, l, acc = _softmax_update(s, v, n_mask[None, :], m, l, acc, scale_log2, DOT_F32)
    if ROPE:
        if cached < hi:
            m, l, acc = _new_token(row, kvh, i, i_mask, d, d_mask, cos, sin, K_NORM, eps, CACHE, KV_SCALE, SLOTS,
                                   b, stride_kv, stride_cs, stride_ch, q1, q2, m, l, acc, scale_log2,
                                   HEAD_DIM, HALF, NUM_HEADS, NUM_KV_HEADS, QK_NORM, KV_FP8)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(OUT + q_row * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=o_mask)
    else:
        tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
                 mask=o_mask)
        tl.store(M_OUT + b * stride_mb + heads * stride_mh + split, m, mask=g_mask)
        tl.store(L_OUT + b * stride_mb + heads * stride_mh + split, l, mask=g_mask)


@triton.jit
def _new_token(row, kvh, i, i_mask, d, d_mask, cos, sin, K_NORM, eps, CACHE, KV_SCALE, SLOTS, b,
               stride_kv, stride_cs, stride_ch, q1, q2, m, l, acc, scale_log2,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
               QK_NORM: tl.constexpr, KV_FP8: tl.constexpr):
    """The decode token's key (rotated) and value of KV head ``kvh`` stored at its slot, as
    ``rotary_kv_write`` stores them, and attended by the queries from registers, as the cache now
    holds them (float8: the stored codes; the head's scales are in ``scale_log2`` and applied to
    the output already)."""
    one = tl.arange(0, 1)
    k1, k2 = _rotated_heads(row + NUM_HEADS * HEAD_DIM, kvh + one, one < 1, i, i_mask, cos, sin, K_NORM, eps,
                            HEAD_DIM, HALF, QK_NORM)
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM + d, mask=d_mask, other=0.0).to(tl.float32)
    dst = CACHE + tl.load(SLOTS + b).to(tl.int64) * stride_cs + kvh * stride_ch
    k1 = _store_kv(dst + i[None, :], k1, i_mask[None, :], KV_SCALE + kvh, KV_FP8)
    k2 = _store_kv(dst + HALF + i[None, :], k2, i_mask[None, :], KV_SCALE + kvh, KV_FP8)
    v = _store_kv(dst + stride_kv + d, v, d_mask, KV_SCALE + NUM_KV_HEADS + kvh, KV_FP8)
    s = (tl.sum(q1.to(tl.float32) * k1, 1) + tl.sum(q2.to(tl.float32) * k2, 1)) * scale_log2
    m_new = tl.maximum(m, s)
    p = tl.exp2(s - m_new)
    alpha = tl.exp2(m - m_new)
    if KV_FP8:  # p rounded as the tiles' product rounds it: to the dtype of the values it multiplies
        p = p.to(q1.dtype).to(tl.float32)
    else:
        p = p.to(CACHE.dtype.element_ty).to(tl.float32)
    return m_new, l * alpha + p, acc * alpha[:, None] + p[:, None] * v[None, :]


@triton.jit
def _single_query_row(QUERY_START, b):
    """``(row, single)``: where sequence b's queries start in a flat batch, and whether it has one."""
    row = tl.load(QUERY_START + b).to(tl.int64)
    return row, tl.load(QUERY_START + b + 1).to(tl.int64) - row == 1


@triton.jit
def _combine_splits_kernel(
    PARTIAL, M_IN, L_IN, QUERY_START, OUT, stride_pb, stride_ph, stride_ps, stride_mb, stride_mh, stride_ob,
    stride_oh, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MIXED: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (sequence, head): the splits' partial outputs weighted by their softmax mass.
    MIXED: into row ``query_start[b]``, for a sequence of one query only (``_decode_attention_kernel``'s)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    row, m_other, l_other = b, float("-inf"), 0.0
    if MIXED:  # masks as in _decode_attention_kernel
        row, single = _single_query_row(QUERY_START, b)
        s_mask = s < tl.where(single, NUM_SPLITS, 0)
        d_mask = d < tl.where(single, HEAD_DIM, 0)
        # another sequence's program weighs empty splits alike: no NaN on the way to its masked store
        m_other, l_other = tl.where(single, float("-inf"), 0.0), tl.where(single, 0.0, 1.0)
    m = tl.load(M_IN + b * stride_mb + h * stride_mh + s, mask=s_mask, other=m_other)
    l = tl.load(L_IN + b * stride_mb + h * stride_mh + s, mask=s_mask, other=l_other)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max)) * l
    o = tl.load(PARTIAL + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + row * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d_mask)


def decode_splits(max_len: int, num_seqs: int, num_kv_heads: int, block_n: int = 64, num_sms: int = 132) -> int:
    """Splits of the keys (flash-decoding) for a batch whose sequences hold at most ``max_len``
    tokens: enough programs to fill the GPU, none with fewer than ``block_n`` keys."""
    want = max(1, -(-2 * num_sms // max(num_seqs * num_kv_heads, 1)))
    return min(_pow2(want), _pow2(max(1, max_len // block_n)), 64)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int | None = None,
                           num_splits: int = 1, out: torch.Tensor | None = None, block_n: int = 64,
                           kv_scale: torch.Tensor | None = None, query_start: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """Attention of one new query per sequence ``q`` ``[num_seqs, num_heads, head_dim]`` over the
    first ``seq_lens[i]`` cached tokens of sequence i (its own K/V already written), the last
    ``window`` only when given. Query heads sharing a KV head go in one program; with
    ``num_splits`` > 1 the keys are split among programs and combined (flash-decoding). The
    grid depends on shapes and ``num_splits`` only, never on the lengths: a CUDA graph holds it.
    A float8 ``kv_cache`` needs its ``kv_scale``.

    With ``query_start`` (``[num_seqs + 1]``, a flat batch's, as ``paged_prefill_attention`` takes
    it), the decode rows of a prompt step: ``q`` and ``out`` (required) are ``[num_tokens,
    num_heads, head_dim]``, a sequence of one query has it at row ``query_start[i]``, and the rows
    of other sequences are neither read nor written (the prefill kernel's, ``decodes_apart``)."""
    assert query_start is None or (out is not None and query_start.shape == (seq_lens.shape[0] + 1,))
    return _decode_attention(q, kv_cache, block_tables, seq_lens, scale, window, num_splits, out, block_n, kv_scale,
                             query_start=query_start)


def rotary_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                            slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_heads: int,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            window: int | None = None, num_splits: int = 1, q_norm: torch.Tensor | None = None,
                            k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                            kv_scale: torch.Tensor | None = None, block_n: int = 64) -> torch.Tensor:
    """``rotary_kv_write`` then ``paged_decode_attention`` for a decode batch (row i: sequence i's
    new token, at ``positions[i] = seq_lens[i] - 1`` and ``slot_mapping[i]``), in one launch (two
    with split-K): the attention's programs rotate the query heads they hold, and the one holding a
    sequence's new token writes its key and value and attends them from registers. Returns the
    attention output ``[num_seqs, num_heads, head_dim]`` in ``qkv``'s dtype; the cache as
    ``rotary_kv_write`` leaves it."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and kv_cache.is_contiguous()
    assert (q_norm is None) == (k_norm is None)
    q = qkv.view(qkv.shape[0], -1, head_dim)  # the q heads, then k's and v's: the grid reads num_heads of them
    rope = dict(cos=cos, sin=sin, positions=positions, slots=slot_mapping, q_norm=q_norm, k_norm=k_norm, eps=eps,
                num_heads=num_heads)
    return _decode_attention(q, kv_cache, block_tables, seq_lens, scale, window, num_splits, None, block_n, kv_scale,
                             rope)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, window: int | None, num_splits: int, out: torch.Tensor | None, block_n: int,
                      kv_scale: torch.Tensor | None, rope: dict | None = None,
                      query_start: torch.Tensor | None = None) -> torch.Tensor:
    num_seqs, head_dim = q.shape[0] if query_start is None else seq_lens.shape[0], q.shape[2]
    num_heads = q.shape[1] if rope is None else rope["num_heads"]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    fp8 = _kv_fp8(kv_cache, kv_scale)
    words = _reads_words(fp8, q, head_dim)
    half = head_dim // 2
    block_d, block_g = _pow2(head_dim, 16), _pow2(group, 16)  # the query heads padded to tl.dot's 16 rows
    qk_norm = rope is not None and rope["q_norm"] is not None
    consts = dict(BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, HALF=half,
                  BLOCK_HALF=_pow2(half, 16), BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=num_splits,
                  DOT_F32=_dot_f32(q, kv_cache), KV_FP8=fp8, ROPE=rope is not None, NUM_HEADS=num_heads,
                  NUM_KV_HEADS=num_kv_heads, QK_NORM=qk_norm, MIXED=query_start is not None, KV_WORDS=words,
                  PTX=not INTERPRETED, **attention_launch(block_g, block_d, block_n, _dot_itemsize(q, kv_cache)),
                  **pdl(q.device))
    rope = rope or dict(cos=q, sin=q, positions=seq_lens, slots=seq_lens, eps=0.0)
    norms = (rope["q_norm"], rope["k_norm"]) if qk_norm else (q, q)
    tensors = (rope["cos"], rope["sin"], rope["positions"], rope["slots"], *norms)
    args = (float(scale) * LOG2E, int(window or NO_WINDOW), float(rope["eps"]), q.stride(0), q.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), num_kv_heads,
            block_tables.stride(0))
    scales = kv_scale if fp8 else q
    cache_words = kv_cache.view(torch.int32) if words else kv_cache
    starts = seq_lens if query_start is None else query_start
    grid = (num_seqs, num_kv_heads, num_splits)
    if num_splits == 1:
        _decode_attention_kernel[grid](q, kv_cache, cache_words, scales, block_tables, seq_lens, starts, out, out, out,
                                       *tensors, *args, out.stride(0), out.stride(1), 0, 0, 0, rope["cos"].stride(0),
                                       **consts)
        return out
    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _decode_attention_kernel[grid](q, kv_cache, cache_words, scales, block_tables, seq_lens, starts, partial, m, l,
                                   *tensors, *args, partial.stride(0), partial.stride(1), partial.stride(2),
                                   m.stride(0), m.stride(1), rope["cos"].stride(0), **consts)
    _combine_splits_kernel[(num_seqs, num_heads)](
        partial, m, l, starts, out, partial.stride(0), partial.stride(1), partial.stride(2), m.stride(0),
        m.stride(1), out.stride(0), out.stride(1), NUM_SPLITS=num_splits, BLOCK_S=_pow2(num_splits, 2),
        HEAD_DIM=head_dim, BLOCK_D=block_d, MIXED=query_start is not None, **pdl(q.device))
    return out


@triton.jit
def _prefill_attention_kernel(
    Q, CACHE, WORDS, KV_SCALE, BLOCK_TABLES, QUERY_START, SEQ_LENS, OUT,
    scale_log2, window,
    stride_qt, stride_qh, stride_kv, stride_cb, stride_cs, stride_ch, stride_sk, stride_bt, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, KV_FP8: tl.constexpr,
    DECODES_APART: tl.constexpr, KV_WORDS: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr, num_seqs,
):
    """One program: BLOCK_M consecutive queries of one sequence, one query head. The grid's first
    axis is the batch's query blocks, flat: sequence ``s`` owns the programs from
    ``query_start[s] // BLOCK_M + s`` on, room for its ``ceil(q_len / BLOCK_M)`` blocks (and one
    empty program at most), so the grid grows with the tokens and the sequences, not with their
    product (a CUDA graph's grid for 64 sequences of up to 512 tokens was 64 x 8 blocks a head,
    of which a lone 512-token prompt used 8). DECODES_APART: the sequences of one query are
    the decode kernel's (``paged_decode_attention`` with ``query_start``): their programs scan and
    store nothing. KV_WORDS: a float8 cache read as words, as ``_decode_attention_kernel`` reads it."""
    pdl_wait(PDL)
    block = tl.program_id(0)
    h = tl.program_id(1)
    # The owner: the last sequence whose first program is at most this one (a binary search).
    seq = tl.zeros([], tl.int32)
    last = seq + num_seqs - 1
    while seq < last:
        mid = (seq + last + 1) // 2
        owns = tl.load(QUERY_START + mid).to(tl.int32) // BLOCK_M + mid <= block
        seq, last = tl.where(owns, mid, seq), tl.where(owns, last, mid - 1)
    kvh = h // GROUP
    scale_log2, v_scale = _head_scales(KV_SCALE, kvh, stride_sk, scale_log2, KV_FP8)
    q_start = tl.load(QUERY_START + seq).to(tl.int32)
    mblk = block - (q_start // BLOCK_M + seq)
    q_len = tl.load(QUERY_START + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(SEQ_LENS + seq).to(tl.int32)
    context = seq_len - q_len  # tokens cached before this chunk: the first query's position
    owned = q_len  # the queries this launch attends
    if DECODES_APART:
        owned = tl.where(q_len == 1, 0, q_len)
    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < owned
    pos = context + rows
    tokens = (q_start + rows).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + tokens[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_WORDS:
        q = _float16(q)
        w = tl.arange(0, BLOCK_D // 4)
        w_mask = w < HEAD_DIM // 4
        v_words = stride_kv // 4

    lo = tl.maximum(context + mblk * BLOCK_M - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(context + tl.minimum((mblk + 1) * BLOCK_M, q_len), seq_len)
    # A sequence's one spare program past its queries scans nothing, nor (DECODES_APART) a decode row's.
    hi = tl.where(mblk * BLOCK_M < owned, hi, lo)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        if KV_WORDS:
            key_words = _paged_offsets(BLOCK_TABLES + seq * stride_bt, n, n_mask, kvh, stride_cb, stride_cs,
                                       stride_ch, BLOCK_SIZE) >> 2
            kv_mask = n_mask[:, None] & w_mask[None, :]
            k = _e4m3_tile(WORDS, key_words, w, kv_mask, PTX)
            v = _e4m3_tile(WORDS, key_words + v_words, w, kv_mask, PTX)
        else:
            k, v = _paged_kv_tile(CACHE, BLOCK_TABLES + seq * stride_bt, n, n_mask, d, d_mask, kvh,
                                  stride_kv, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            if KV_FP8:
                k, v = k.to(q.dtype), v.to(q.dtype)
        visible = n_mask[None, :] & (n[None, :] <= pos[:, None]) & (n[None, :] > pos[:, None] - window)
        m, l, acc = _online_softmax_step(q, k, v, visible, m, l, acc, scale_log2, DOT_F32)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    tl.store(OUT + tokens[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                            window: int | None = None, out: torch.Tensor | None = None, block_m: int = 64,
                            block_n: int = 64, kv_scale: torch.Tensor | None = None,
                            decodes_apart: bool = False) -> torch.Tensor:
    """Causal attention of a flat batch of chunks: sequence i's ``query_start[i+1] - query_start[i]``
    queries ``q`` ``[num_tokens, num_heads, head_dim]`` are the last of its ``seq_lens[i]``
    tokens, whose K/V (this chunk's included) are in the cache; each query attends the tokens up
    to its own position (the last ``window`` of them when given). A chunk of one query is a decode,
    so this serves mixed batches, chunked prefill and prefix-cache hits alike. A float8 ``kv_cache``
    needs its ``kv_scale``. ``decodes_apart``: the rows of single-query sequences are left unwritten,
    for ``paged_decode_attention`` with ``query_start`` (GQA-packed, split-K): here a decode row is
    a tile of BLOCK_M rows a query head, one of them real (~5x its decode-step cost on an H200)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(q) if out is None else out
    fp8 = _kv_fp8(kv_cache, kv_scale)
    words = _reads_words(fp8, q, head_dim)
    block_m, block_d = min(block_m, _pow2(max_query_len, 16)), _pow2(head_dim, 16)
    num_seqs = seq_lens.shape[0]
    grid = (num_tokens // block_m + num_seqs, num_heads)
    _prefill_attention_kernel[grid](
        q, kv_cache, kv_cache.view(torch.int32) if words else kv_cache, kv_scale if fp8 else q, block_tables,
        query_start, seq_lens, out, float(scale) * LOG2E,
        int(window or NO_WINDOW), q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), kv_cache.stride(3), num_kv_heads, block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=_dot_f32(q, kv_cache), KV_FP8=fp8, DECODES_APART=decodes_apart,
        KV_WORDS=words, PTX=not INTERPRETED, num_seqs=num_seqs,
        **attention_launch(block_m, block_d, block_n, _dot_itemsize(q, kv_cache)), **pdl(q.device))
    return out


# --- rotary + KV write -----------------------------------------------------------------------


@triton.jit
def _head_rms_norm(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """RMSNorm of heads given as their halves ``x1``, ``x2`` (float32, zeros where masked; one head
    ``[BLOCK_HALF]`` or several ``[heads, BLOCK_HALF]``), as vivace's RMSNorm rounds it: the
    normalized value rounded to DTYPE, times the weight (``[BLOCK_HALF]``), rounded."""
    inv = tl.rsqrt((tl.sum(x1 * x1, -1, keep_dims=True) + tl.sum(x2 * x2, -1, keep_dims=True)) / HEAD_DIM + eps)
    y1 = ((x1 * inv).to(DTYPE).to(tl.float32) * w1).to(DTYPE).to(tl.float32)
    y2 = ((x2 * inv).to(DTYPE).to(tl.float32) * w2).to(DTYPE).to(tl.float32)
    return y1, y2


@triton.jit
def round_e4m3(x):
    """``x`` (float32, within +-448) rounded to the nearest float8 e4m3 value, ties to even, in
    float32 arithmetic, so that the cast that follows is exact on a GPU and under the interpreter
    alike (Triton 3.9's interpreter rounds without carrying into the exponent: 31.8 became 16)."""
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormal below 2^-6
    step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): 3 mantissa bits
    magic = step * 12582912.0  # 1.5 * 2^23 steps: the sum's last bit is worth one step
    return (x + magic) - magic


@triton.jit
def _store_kv(dst, x, mask, SCALE, KV_FP8: tl.constexpr):
    """Store float32 ``x`` into the cache at ``dst``: rounded to its dtype, or, float8, divided by
    the head's scale at ``SCALE``, clamped to +-448 (saturating, never NaN), rounded to e4m3.
    Returns what was stored, in float32."""
    if KV_FP8:
        x = tl.math.div_rn(x, tl.load(SCALE))
        x = round_e4m3(tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX))
    stored = x.to(dst.dtype.element_ty)
    tl.store(dst, stored, mask=mask)
    return stored.to(tl.float32)


@triton.jit
def _rotary_kv_write_kernel(
    QKV, COS, SIN, POSITIONS, SLOTS, Q_OUT, CACHE, KV_SCALE, Q_NORM, K_NORM, eps,
    stride_t, stride_cos, stride_qt, stride_qh, stride_kv, stride_slot, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
):
    """One program: one token, one head of q or k (k's program also stores v): with QK_NORM the
    head's RMSNorm (q's or k's weight) first, then the rotation of pairs (i, i + HEAD_DIM/2) by the
    token's position; q to Q_OUT, k and v to the token's slot (quantized with KV_FP8)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    pos = tl.load(POSITIONS + t).to(tl.int64)
    cos = tl.load(COS + pos * stride_cos + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos * stride_cos + i, mask=mask, other=0.0).to(tl.float32)
    src = QKV + t * stride_t + head * HEAD_DIM
    x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # both weights loaded, one chosen: a select, not a branch over pointers
        is_q = head < NUM_HEADS
        w1 = tl.where(is_q, tl.load(Q_NORM + i, mask=mask, other=0.0), tl.load(K_NORM + i, mask=mask, other=0.0))
        w2 = tl.where(is_q, tl.load(Q_NORM + HALF + i, mask=mask, other=0.0),
                      tl.load(K_NORM + HALF + i, mask=mask, other=0.0))
        x1, x2 = _head_rms_norm(x1, x2, w1.to(tl.float32), w2.to(tl.float32), eps, HEAD_DIM,
                                QKV.dtype.element_ty)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    # A name bound in both branches of a runtime `if` must have one type when compiled (the
    # interpreter does not check): q's and the cache's pointers get names of their own.
    if head < NUM_HEADS:
        q_dst = Q_OUT + t * stride_qt + head * stride_qh
        tl.store(q_dst + i, o1.to(Q_OUT.dtype.element_ty), mask=mask)
        tl.store(q_dst + HALF + i, o2.to(Q_OUT.dtype.element_ty), mask=mask)
    else:
        kvh = head - NUM_HEADS
        slot = tl.load(SLOTS + t).to(tl.int64)
        kv_dst = CACHE + slot * stride_slot + kvh * stride_ch
        _store_kv(kv_dst + i, o1, mask, KV_SCALE + kvh, KV_FP8)
        _store_kv(kv_dst + HALF + i, o2, mask, KV_SCALE + kvh, KV_FP8)
        v_src = src + NUM_KV_HEADS * HEAD_DIM
        v1 = tl.load(v_src + i, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + HALF + i, mask=mask, other=0.0).to(tl.float32)
        _store_kv(kv_dst + stride_kv + i, v1, mask, KV_SCALE + NUM_KV_HEADS + kvh, KV_FP8)
        _store_kv(kv_dst + stride_kv + HALF + i, v2, mask, KV_SCALE + NUM_KV_HEADS + kvh, KV_FP8)


def rotary_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_heads: int,
                    q_out: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                    k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                    kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """From ``qkv`` ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]`` (q, k, v heads in
    that order, as vivace's fused projection gives them): the rotated q ``[num_tokens, num_heads,
    head_dim]`` returned; rotated k and v stored at each token's slot of ``kv_cache``. ``cos``,
    ``sin``: ``[max_positions, head_dim // 2]`` tables (``RotaryEmbedding``'s). With ``q_norm`` and
    ``k_norm`` (``[head_dim]`` weights, Qwen3's and Gemma 3's), each q and k head is RMS-normed
    (``eps``) before its rotation. A float8 ``kv_cache`` needs its ``kv_scale``: k and v are
    stored divided by their head's scale, clamped to +-448, rounded to nearest even. One launch."""
    num_tokens = qkv.shape[0]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and kv_cache.is_contiguous()
    assert (q_norm is None) == (k_norm is None)
    if q_out is None:
        q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    norm = q_norm is not None
    fp8 = _kv_fp8(kv_cache, kv_scale)
    _rotary_kv_write_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, cos, sin, positions, slot_mapping, q_out, kv_cache, kv_scale if fp8 else qkv,
        q_norm if norm else qkv, k_norm if norm else qkv, eps, qkv.stride(0), cos.stride(0), q_out.stride(0),
        q_out.stride(1), kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=_pow2(half), QK_NORM=norm,
        KV_FP8=fp8, num_warps=1, **pdl(qkv.device))  # a program is one head: 64 pairs for head_dim 128
    return q_out


# --- norms and activations -------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(X, RES, W, OUT, stride_x, stride_r, stride_o, N, eps,
                     HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row: (residual += x), then RMSNorm of it, as Hugging Face rounds it."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(RES + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(RES + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, 0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: x * (1 + w), in float32, rounded once
        y = x32 * inv * (1.0 + w)
    else:  # Llama: the normalized value rounded to the input dtype, then times w
        y = (x32 * inv).to(x.dtype).to(tl.float32) * w
    tl.store(OUT + row * stride_o + cols, y.to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             unit_offset: bool = False, out: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` ``[num_tokens, hidden]`` (weight ``1 + w`` with ``unit_offset``); with
    ``residual``, of ``residual + x``, written into ``residual``: returns ``(normed, residual)``.
    One launch either way."""
    num_tokens, hidden = x.shape
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device) if out is None else out
    res = x if residual is None else residual
    _rms_norm_kernel[(num_tokens,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
                                    HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
                                    BLOCK=_pow2(hidden), num_warps=_row_warps(_pow2(hidden)), **pdl(x.device))
    return out if residual is None else (out, residual)


def _row_warps(block: int) -> int:
    """Warps for a program that holds one row of ``block`` elements: about 16 a thread, 4 to 16 warps."""
    return min(max(block // 512, 4), 16)


@triton.jit
def _gated_product(gate, up, GELU: tl.constexpr):
    """``act(gate) * up`` in the inputs' dtype: SiLU, or GELU's tanh approximation, whose
    ``0.5 g (1 + tanh(y))`` is ``g * sigmoid(2 y)`` (no tanh needed). The activation is rounded to
    the input dtype before the product, and the product after it, as torch's two ops round."""
    g = gate.to(tl.float32)
    if GELU:
        act = g / (1.0 + tl.exp(-2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g)))  # sqrt(2 / pi)
    else:
        act = g / (1.0 + tl.exp(-g))
    return (act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _gated_activation_kernel(X, OUT, stride_x, stride_o, WIDTH, GELU: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
    """``act(gate) * up`` (``_gated_product``) for one row's BLOCK columns."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + WIDTH + cols, mask=mask, other=0.0)
    tl.store(OUT + row * stride_o + cols, _gated_product(gate, up, GELU).to(OUT.dtype.element_ty), mask=mask)


def _gated_activation(x: torch.Tensor, gelu: bool, out: torch.Tensor | None, block: int) -> torch.Tensor:
    num_tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device) if out is None else out
    block = min(block, _pow2(width))
    _gated_activation_kernel[(num_tokens, triton.cdiv(width, block))](x, out, x.stride(0), out.stride(0), width,
                                                                      GELU=gelu, BLOCK=block, **pdl(x.device))
    return out


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` ``[num_tokens, 2 * width]``, rounding as torch does."""
    return _gated_activation(x, False, out, block)


def gelu_tanh_mul(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (Gemma's MLP) for ``x = [gate | up]``
    ``[num_tokens, 2 * width]``, rounding as torch does."""
    return _gated_activation(x, True, out, block)


# --- batch-1 GEMV ----------------------------------------------------------------------------


@triton.jit
def _gemv_x(X, NORM_W, cols, col_mask, K, inv, GATED: tl.constexpr, GELU: tl.constexpr, NORM: tl.constexpr):
    """The tile ``cols`` of the GEMV's vector in float32, as the product reads it: GATED, ``act(gate)
    * up`` of ``X = [gate | up]``; NORM, ``X``'s RMSNorm (``inv``: its reciprocal root mean square)
    times ``NORM_W``, rounded as ``rms_norm`` rounds it; else ``X`` as it is."""
    if GATED:
        gate = tl.load(X + cols, mask=col_mask, other=0.0)
        up = tl.load(X + K + cols, mask=col_mask, other=0.0)
        x = _gated_product(gate, up, GELU)
    else:
        x = tl.load(X + cols, mask=col_mask, other=0.0)
        if NORM:
            w = tl.load(NORM_W + cols, mask=col_mask, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) * inv).to(x.dtype).to(tl.float32) * w).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _rms_inv(X, K, eps, BLOCK_K: tl.constexpr):
    """``1 / sqrt(mean(X^2) + eps)`` over X's K values, in float32."""
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
        squares += x * x
    return tl.rsqrt(tl.sum(squares, 0) / K + eps)


@triton.jit
def _gemv_kernel(W, X, Y, BIAS, NORM_W, RES, N, K, k_per_split, stride_w, stride_ys, eps, HAS_BIAS: tl.constexpr,
                 GATED: tl.constexpr, GELU: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    """One program: BLOCK_N rows of ``W`` against ``x``, the columns of one split of K in BLOCK_K
    tiles, float32 accumulation. GATED: ``x`` is ``[gate | up]`` (2K values) and the product takes
    ``act(gate) * up`` (``_gated_product``), so an MLP's down projection needs no launch of its own
    for the activation. NORM: ``x`` is the residual stream and the product takes its RMSNorm (weight
    NORM_W), each program finding the root mean square over all of x itself (K values from L2),
    so the norm needs no launch either. Split, it writes float32 partial sums ``Y[split]``
    (``sum_splits`` adds them, the bias and RES); else the result (+ bias), rounded to Y's dtype,
    (RESIDUAL: + RES, rounded again, as ``residual + linear(x)`` rounds) in Y's dtype. Y may be RES:
    a program reads its rows of RES before it writes them, and no other program touches them."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_mask = rows < N
    w_rows = W + rows.to(tl.int64)[:, None] * stride_w
    lo = split * k_per_split
    hi = tl.minimum(lo + k_per_split, K)
    inv = 1.0
    if NORM:
        inv = _rms_inv(X, K, eps, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < hi
        x = _gemv_x(X, NORM_W, cols, col_mask, K, inv, GATED, GELU, NORM)
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    if SPLIT:
        tl.store(Y + split * stride_ys + rows, acc, mask=row_mask)
    else:
        _store_rows(acc, Y, BIAS, RES, rows, row_mask, N, HAS_BIAS, RESIDUAL)


@triton.jit
def _store_rows(acc, Y, BIAS, RES, i, mask, N, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    """A linear layer's float32 outputs ``acc`` at flat indices ``i`` of Y ``[M, N]``: + bias
    (``[N]``), rounded to Y's dtype; RESIDUAL: + RES (``[M, N]``), rounded again."""
    if HAS_BIAS:
        acc += tl.load(BIAS + i % N, mask=mask, other=0.0).to(tl.float32)
    y = acc.to(Y.dtype.element_ty)
    if RESIDUAL:
        y = (y.to(tl.float32) + tl.load(RES + i, mask=mask, other=0.0).to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + i, y, mask=mask)


def gemv(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None, gated: str | None = None,
         out: torch.Tensor | None = None, block_n: int = 8, block_k: int = 512, splits: int = 1,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None
         ) -> torch.Tensor:
    """``x @ weight.T + bias`` for one row ``x`` (``[K]`` or ``[1, K]``; the result has its shape
    with N for K): a batch-1 linear layer. ``gated`` "silu" or "gelu": ``x`` is an MLP's
    ``[gate | up]`` (``[2K]``), multiplied as ``silu_mul(x)`` / ``gelu_tanh_mul(x)`` would give it.
    ``norm_weight``: ``x`` is the residual stream, multiplied as ``rms_norm(x, norm_weight, eps)``
    would give it. ``residual``: returns ``residual + x @ weight.T + bias``, written into
    ``residual`` (unless ``out`` is given), as the layer's ``residual + linear(...)``; so a
    decoder layer at batch 1 needs no norm launches when its projections all take the GEMV.
    ``splits`` > 1 splits K among that many programs a row block (float32 partials, summed by a
    second launch): more loads in flight for a long K (an MLP's down projection).
    The forward uses it for the projections where it beat cuBLAS at start (``forward.choose_gemv``)."""
    n, k = weight.shape
    flat = x.reshape(-1)
    assert weight.stride(1) == 1 and flat.is_contiguous() and flat.numel() == (2 * k if gated else k)
    assert gated is None or norm_weight is None
    shape = (*x.shape[:-1], n)
    if out is None:
        out = residual if residual is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    # every program reads all of x for the norm: x must not be what the programs write
    assert residual is None or (residual.is_contiguous() and residual.numel() == n
                                and (norm_weight is None or residual.data_ptr() != flat.data_ptr()))
    block_k = min(block_k, _pow2(k, 16))
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), max(splits, 1)) * block_k
    splits = triton.cdiv(k, k_per_split)
    target = out if splits == 1 else torch.empty(splits, 1, n, dtype=torch.float32, device=x.device)
    bias_or_any = weight if bias is None else bias
    res_or_any = out if residual is None else residual
    _gemv_kernel[(triton.cdiv(n, block_n), splits)](
        weight, flat, target, bias_or_any, weight if norm_weight is None else norm_weight, res_or_any, n, k,
        k_per_split, weight.stride(0), n, float(eps), HAS_BIAS=bias is not None, GATED=gated is not None,
        GELU=gated == "gelu", NORM=norm_weight is not None, RESIDUAL=residual is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT=splits > 1, **pdl(x.device))
    if splits > 1:
        sum_splits(target, out.view(1, n), bias_or_any, bias is not None, residual)
    return out


@triton.jit
def sum_splits_kernel(P, Y, BIAS, RES, N, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                      RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """``Y = sum(P[s]) (+ bias) (+ RES)`` over the SPLITS float32 partials of a split-K GEMV,
    ``[M, N]`` flat, rounded as ``_store_rows`` rounds."""
    pdl_wait(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(P + s * MN + i, mask=mask, other=0.0)
    _store_rows(acc, Y, BIAS, RES, i, mask, N, HAS_BIAS, RESIDUAL)


def sum_splits(partials: torch.Tensor, out: torch.Tensor, bias: torch.Tensor, has_bias: bool,
               residual: torch.Tensor | None = None) -> None:
    """``out = sum(partials) (+ bias) (+ residual)`` over a split-K GEMV's float32 partial sums
    ``[splits, M, N]``."""
    splits, m, n = partials.shape
    block = 1024
    sum_splits_kernel[(triton.cdiv(m * n, block),)](partials, out, bias, out if residual is None else residual, n,
                                                     m * n, SPLITS=splits, BLOCK=block, HAS_BIAS=has_bias,
                                                     RESIDUAL=residual is not None, **pdl(partials.device))
