"""Triton kernels for ``y = x @ dequant(W)^T`` where ``W`` stays in device memory as a GGUF file's
bytes, reordered into planes (``planar``): ``uint8 [out_features, bytes_per_row]``, as many bytes
as the file's blocks. Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (layouts: ggml's ``block_*`` structs,
and ``gguf.quants``' reference dequantizers, against which the tests check every kernel).

**Planar rows.** A file row is a run of blocks (Q4_0: 18 bytes = float16 ``d`` + 16 bytes of
nibbles), whose 18-, 20-, 22-, 24-, 34-, 144-, 176- or 210-byte stride leaves a kernel 1- or 2-byte
loads. ``planar`` reorders each row's bytes into planes, each the same field of every block in a row:
Q4_0 ``[qs | d]``, Q4_1 ``[qs | d | m]``, Q5_0 ``[qs | qh | d]``, Q5_1 ``[qs | qh | d | m]``, Q8_0
``[qs | d]``, Q4_K ``[qs | meta]``, Q5_K
``[qs | qh | meta]``, Q6_K ``[ql_lo | ql_hi | qh | scales | d]`` (``meta``: a super-block's 12
scale bytes, then ``d`` and ``dmin``, 16 bytes). A kernel's *unit* is ``LANES`` columns of each of
``PLANES`` sub-blocks (``BlockLayout``); a code plane holds ``LANES`` bytes per unit in unit
order, so a tile of units of a row is one contiguous run, read 16 bytes a thread. Where the
file's fields do not serve a unit as they lie, the same bits are stored otherwise: Q6_K's ``ql``
split by unit and nibble half, its scales per unit; Q5_K's ``qh`` as two 32-bit words per unit,
one per half of its lanes, a lane's two fifth bits side by side; Q8_0's int8 codes as unsigned
``q + 128``. Q5_0's and Q5_1's ``qh`` needs nothing of the kind: it is already one little-endian
32-bit word per unit (a block), bit c the fifth bit of column c, so lane j's two bits sit at the
constant shifts j and j + 16 of the word a thread loads beside its 16 bytes of nibbles (laid out as
Q4_0's). Every plane starts 16-byte aligned when K is a multiple of 256 (Q6_K: of 2,048, its
rows being 210 bytes per 256 columns); otherwise the kernels are told the largest power of two
(to 16) that divides a row's bytes (``ROW_ALIGN``, ``_row_offsets``) and load that many at a time.
Told nothing (the JIT hints only multiples of 16), the compiler loaded such rows a byte at a time
and spread a unit's lanes over threads, its sums shuffles: on sm_90 the default GEMV tiling's loop
took 970 instructions for SmolLM2's Q4_1 rows (576 columns, 360 bytes, 8-aligned) against 376
told; Gemma 3's Q5_0 rows (640 columns, 440 bytes) 887 against 576, and two of its tilings
spilled (160- and 488-byte stack frames), none told.

**Decoding** (``_units``): codes become float32 by OR-ing them into the bits of 2^23 and
subtracting 2^23 plus their offset (exact; an integer-to-float conversion runs at a quarter of the
rate), a high nibble kept in place (16 times its value, the 1/16 folded into the scale). A unit's
weights are then ``a * f + b`` for codes ``f [BLOCK_N, NU, LANES, PLANES]`` and per-sub-block
``a``, ``b`` ``[BLOCK_N, NU, PLANES]`` (``b`` only where a type has a minimum), columns
``[NU, LANES, PLANES]`` (``_unit_cols``): x is gathered in that order, which costs nothing.

- Small batches (``M <= GEMV_MAX_ROWS``, decode): a GEMV tiled by ``kernels.GemvConfig``. Per step a
  thread multiplies its 16-byte vector of codes by x in float32 and sums along its lanes: the
  cross-thread reduction over a tile's units happens once, after the last step (``acc_2d``), or
  each step. K is split among programs (partial sums in float32, added by ``kernels.sum_splits``)
  when the rows alone give too few programs to fill the GPU.
  Q8_0, Q4_0, Q4_1, Q4_K and Q6_K rows of a multiple of 16 bytes take ``_word_step`` instead at one or
  two rows of x (``uses_words``; codes decoded from the words they are loaded in; the section above it).
  Q5_0, Q5_1 and Q5_K have no word path (not built): each of their codes needs its fifth bit moved
  in from ``qh``, a shift and a LOP3 more a code in either path, or a float of its own (as Q6_K's
  tops), so the words would save less than Q4's.
- Decode batches (``M <= GEMM_MAX_ROWS``): a tiled GEMM, ``tl.dot`` of ``x``'s tile and the
  dequantized weight tile rounded to ``x``'s dtype, float32 accumulation; one row tile of ``x``,
  so each weight tile is decoded once.
- Prefill (more rows): the weight dequantized into ``x``'s dtype by ``_dequantize_kernel``, in
  slices of at most ``DEQUANT_SLICE_BYTES``, then cuBLAS (llama.cpp's way for large batches). The
  tiled GEMM decoded each weight tile once per 64 rows and ran at ~22 TFLOP/s on an H200: the
  dequantizing pass writes and reads 2 bytes a weight, which a 512-row product repays many times.

Every kernel takes part in programmatic dependent launch (``kernels.pdl``): it waits for the
kernels before it (``pdl_wait``) before it reads x or writes; the GEMV and the dequantizer decode
their first weight tile before that (no kernel writes weights).
Activations are read in their dtype (bf16, fp16, fp32), results written in it. Grids and scratch
sizes depend on shapes only, never on values: CUDA-graph capturable. Only Triton API of both 3.6
and 3.9 is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache

import gguf
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vivace.gpu import kernels
from vivace.gpu.kernels import DOT_F32, GemvConfig, pdl, pdl_wait, sum_splits

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
# The GEMV's default tiling: GEMV_BLOCK_N rows a program, GEMV_VECTORS 16-byte vectors of codes a
# row a step, 4 warps: two rows a thread, so each column of x a thread reads serves two rows (one
# row a thread spent ~6 instructions a Q4_0 weight compiled for sm_90, two ~5, four ~4.5).
GEMV_BLOCK_N = 32
GEMV_VECTORS = 8
GEMM_BLOCK_N, GEMM_BLOCK_K = 64, 128
PROGRAMS_PER_SM = 8  # split K until the GEMV has about this many programs per SM
# The GEMVs (this one, the FP8 one) can sum each tile's products over K inside the loop, a
# cross-thread reduction per step, or keep them per thread and reduce once at the end (ACC_2D,
# registers as the tile's). The launchers' default; VIVACE_GEMV_ACC_2D=1 turns it on, so that
# benchmarks/gpu.py can time both in one device call; the GGUF modules' start-up tuning times both.
GEMV_ACC_2D = os.environ.get("VIVACE_GEMV_ACC_2D") == "1"
MAGIC = 0x4B000000  # the bits of float32 2^23: OR-ed with a code below 2^23, 2^23 + code


@dataclass(frozen=True)
class BlockLayout:
    """One GGUF type's block: ``block_bytes`` bytes hold ``block_cols`` weights, decoded in units
    of ``lanes`` columns of each of ``planes`` sub-blocks (the kernels' step along K); ``fields``:
    per plane of ``planar``, the block's bytes it takes, in order (Q5_K's qh is re-encoded);
    ``has_min``: weights ``a * code + b``, not ``a * code``."""

    block_bytes: int
    block_cols: int
    lanes: int
    planes: int
    fields: tuple[tuple[int, ...], ...]
    has_min: bool = False

    @property
    def unit_cols(self) -> int:
        return self.lanes * self.planes


def _span(start: int, stop: int) -> tuple[int, ...]:
    return tuple(range(start, stop))


# Q6_K: unit (half h, quarter t) of a super-block reads ql[h*64 + t*16 + j] (runs 0, 2) and
# ql[h*64 + 32 + t*16 + j] (runs 1, 3); its four scales are scales[h*8 + t + 2r].
_Q6_QL_LO = sum((_span(h * 64 + t * 16, h * 64 + t * 16 + 16) for h in (0, 1) for t in (0, 1)), ())
_Q6_SCALES = tuple(192 + h * 8 + t + 2 * r for h in (0, 1) for t in (0, 1) for r in range(4))
_K_META = _span(4, 16) + _span(0, 4)  # scales[12], then d and dmin
LAYOUTS = {
    T.Q8_0: BlockLayout(34, 32, 32, 1, (_span(2, 34), (0, 1))),  # f16 d, int8 qs[32]
    T.Q4_0: BlockLayout(18, 32, 16, 2, (_span(2, 18), (0, 1))),  # f16 d, qs[16]: j low nibble, j + 16 high
    T.Q4_1: BlockLayout(20, 32, 16, 2, (_span(4, 20), (0, 1), (2, 3)), True),  # f16 d, f16 m, qs[16]
    T.Q5_0: BlockLayout(22, 32, 16, 2, (_span(6, 22), _span(2, 6), (0, 1))),  # f16 d, qh[4], qs[16] as Q4_0's
    T.Q5_1: BlockLayout(24, 32, 16, 2, (_span(8, 24), _span(4, 8), (0, 1), (2, 3)), True),  # f16 d, f16 m, qh[4], qs
    T.Q4_K: BlockLayout(144, 256, 32, 2, (_span(16, 144), _K_META), True),  # f16 d, f16 dmin, scales[12], qs[128]
    T.Q5_K: BlockLayout(176, 256, 32, 2, (_span(48, 176), _span(16, 48), _K_META), True),  # ..., qh[32], qs[128]
    T.Q6_K: BlockLayout(210, 256, 16, 4, (_Q6_QL_LO, tuple(i + 32 for i in _Q6_QL_LO), _span(128, 192), _Q6_SCALES,
                                          (208, 209))),  # ql[128], qh[64], int8 scales[16], f16 d
}
GPU_TYPES = tuple(LAYOUTS)
# The types whose GEMV decodes codes from the int32 words they are loaded in (``_word_step``), when
# a row's bytes are a multiple of 16 (each row's words then load 16 bytes at a time) and x has at
# most WORD_MAX_ROWS rows (``uses_words``).
WORD_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K)
WORD_MAX_ROWS = 2


def planar(blocks: torch.Tensor, ggml_type: T) -> torch.Tensor:
    """The planar rows (module docstring) of a file's blocks ``uint8 [N, row_bytes]`` of
    ``ggml_type``: same shape and bytes per row, on the same device, by torch ops alone (one
    plane's copy at a time beside the two tensors)."""
    layout = LAYOUTS[ggml_type]
    n, row_bytes = blocks.shape
    per_block = blocks.reshape(n, row_bytes // layout.block_bytes, layout.block_bytes)
    out = torch.empty_like(blocks)
    start = 0
    for index, field in enumerate(layout.fields):
        plane = per_block[:, :, list(field)]
        if ggml_type == T.Q8_0 and index == 0:
            plane ^= 128  # int8 q as the unsigned q + 128
        elif ggml_type == T.Q5_K and index == 1:
            plane = _q5_k_fifth_bits(plane)
        width = plane.shape[1] * plane.shape[2]
        out[:, start:start + width] = plane.reshape(n, width)
        start += width
    return out


def _q5_k_fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_K's ``qh [N, S, 32]`` (bit 2c + p of byte j: fifth bit of column j of sub-block 2c + p) as
    two little-endian 32-bit words per unit c, one per half h of its columns: bit 2k + p of word h,
    the fifth bit of column 16h + k of sub-block 2c + p."""
    bits = torch.stack([(qh >> s) & 1 for s in range(8)], 2)  # [N, S, sub-block 2c + p, column 16h + k]
    bits = bits.reshape(*qh.shape[:2], 4, 2, 2, 16).permute(0, 1, 2, 4, 5, 3)  # [N, S, c, h, k, p]
    octets = bits.reshape(*qh.shape[:2], 4, 2, 4, 8).to(torch.int32)
    packed = (octets << torch.arange(8, device=qh.device, dtype=torch.int32)).sum(-1)
    return packed.to(torch.uint8).reshape(*qh.shape[:2], 32)


# --- decoding a tile of units ----------------------------------------------------------------
# ``row``: byte offsets of the tile's rows [BLOCK_N] (int64); units u0 .. u0 + NU of each, masked
# from ``hi`` and by ``n_mask``. Each loads the tile, calls ``pdl_wait(WAIT)`` (a kernel's first
# tile: its bytes are on their way while the kernel waits, and only they occupy registers), then
# returns codes f [BLOCK_N, NU, LANES, PLANES] (float32) and the scale a and offset b
# [BLOCK_N, NU, PLANES] of ``w = a * f + b`` (b: 0.0 for types without one); ``_unit_cols`` gives
# the columns [NU, LANES, PLANES] of f.


@triton.jit
def _lanes(W, row, start, u0, hi, n_mask, BLOCK_N: tl.constexpr, NU: tl.constexpr, BYTES: tl.constexpr):
    """A plane's bytes, BYTES a unit, from byte ``start`` of each row: [BLOCK_N, NU, BYTES], loaded
    as one contiguous run a row (so 16 bytes a thread); from W as int32, words and word offsets."""
    offs = u0 * BYTES + tl.arange(0, NU * BYTES)
    q = tl.load(W + row[:, None] + start + offs[None, :], mask=n_mask[:, None] & (offs < hi * BYTES)[None, :],
                other=0)
    return tl.reshape(q, [BLOCK_N, NU, BYTES])


@triton.jit
def _code_floats(bits, exponent):
    """The float32s ``2^e + code`` of ``bits`` (a code in mantissa bits only) under ``exponent``
    (the bits of 2^e)."""
    return (bits | exponent).to(tl.float32, bitcast=True)


@triton.jit
def _codes(bits, magic, offset: tl.constexpr):
    """``bits - offset`` in float32 for int32 ``0 <= bits < 2^23``, exactly: ``magic`` (MAGIC, passed
    as an argument so that it sits in a register, where one LOP3 masks a code and ORs it in)."""
    return _code_floats(bits, magic) - (8388608.0 + offset)


@triton.jit
def _f16(WH, hrow, index, mask):
    """The float16 at half-offsets ``hrow`` (rows, [BLOCK_N]) + ``index`` [NU(, k)]."""
    if len(index.shape) == 1:
        ptr = WH + hrow[:, None] + index[None, :]
    else:
        ptr = WH + hrow[:, None, None] + index[None, :, :]
        mask = mask[:, :, None]
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _nibble_planes(q, magic, offset: tl.constexpr):
    """[.., LANES, 2] codes of bytes q: low nibbles less offset, high ones in place (16x) less 16 x offset."""
    q = q.to(tl.int32)
    return tl.join(_codes(q & 15, magic, offset), _codes(q & 240, magic, 16 * offset))


@triton.jit
def _q8_0_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N: tl.constexpr, NU: tl.constexpr,
                WAIT: tl.constexpr):
    """Q8_0: a unit is a block, ``d * q`` for int8 q (stored as q + 128, ``planar``)."""
    u = u0 + tl.arange(0, NU)
    q = _lanes(W, row, 0, u0, hi, n_mask, BLOCK_N, NU, 32)
    d = _f16(WH, row // 2, nblocks * 16 + u, n_mask[:, None] & (u < hi)[None, :])
    pdl_wait(WAIT)
    f = tl.reshape(_codes(q.to(tl.int32), magic, 128), [BLOCK_N, NU, 32, 1])  # not [..., None]: keeps q's layout
    return f, d.to(tl.float32)[:, :, None], 0.0


@triton.jit
def _q4_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N: tl.constexpr, NU: tl.constexpr,
              HAS_MIN: tl.constexpr, FIVE_BITS: tl.constexpr, WAIT: tl.constexpr):
    """Q4_0 (``d * (q - 8)``), Q4_1 (``d * q + m``), Q5_0 (``d * (q - 16)``) and Q5_1 (``d * q + m``): a
    unit is a block, lanes j: columns j (low nibbles) and j + 16 (high ones); Q5's fifth bits in the
    block's ``qh`` word as the file stores it (bit c: column c), loaded beside the nibbles."""
    u = u0 + tl.arange(0, NU)
    mask = n_mask[:, None] & (u < hi)[None, :]
    q = _lanes(W, row, 0, u0, hi, n_mask, BLOCK_N, NU, 16)
    if FIVE_BITS:
        octet = tl.arange(0, 4)
        qh = tl.load(W + row[:, None, None] + (nblocks * 16 + u * 4)[None, :, None] + octet[None, None, :],
                     mask=mask[:, :, None], other=0)
        scale_at = nblocks * 10 + u  # in halves: after qs (16 bytes a block) and qh (4)
    else:
        scale_at = nblocks * 8 + u
    d = _f16(WH, row // 2, scale_at, mask)
    if HAS_MIN:
        m = _f16(WH, row // 2, scale_at + nblocks, mask)
    pdl_wait(WAIT)
    d = d.to(tl.float32)
    a = tl.join(d, d * 0.0625)
    b = 0.0
    if HAS_MIN:
        b = tl.join(m, m).to(tl.float32)
    if FIVE_BITS:
        word = tl.sum(qh.to(tl.int32) << 8 * octet, 2)
        if HAS_MIN:
            f = _five_bit_planes(q, word, magic, 0)
        else:
            f = _five_bit_planes(q, word, magic, 16)
    elif HAS_MIN:
        f = _nibble_planes(q, magic, 0)
    else:
        f = _nibble_planes(q, magic, 8)
    return f, a, b


@triton.jit
def _five_bit_planes(q, word, magic, offset: tl.constexpr):
    """``_nibble_planes`` of bytes q ``[BLOCK_N, NU, 16]`` with fifth bits from ``word [BLOCK_N, NU]``:
    lane j's low nibble takes bit j, its high one (in place, 16x) bit j + 16."""
    q = q.to(tl.int32)
    j = tl.arange(0, 16)[None, None, :]
    word = word[:, :, None]
    low = (q & 15) | (((word >> j) & 1) << 4)
    high = (q & 240) | (((word >> (j + 16)) & 1) << 8)
    return tl.join(_codes(low, magic, offset), _codes(high, magic, 16 * offset))


@triton.jit
def _k_meta(W, WH, row, meta, u, mask):
    """Q4_K/Q5_K: the bytes of unit u's two six-bit scales and mins [BLOCK_N, NU, 2] (of sub-blocks
    2c, 2c + 1, c = u % 4: for s < 4, the low bits of bytes s and s + 4; for s >= 4, the nibbles
    of byte s + 4 and the top bits of bytes s - 4 and s of the super-block's 16 meta bytes at byte
    ``meta``), and its ``d``, ``dmin``."""
    i = tl.arange(0, 2)
    at = W + row[:, None, None] + (meta + u // 4 * 16 + u % 2 * 2)[None, :, None] + i[None, None, :]
    mask3 = mask[:, :, None]
    low = tl.load(at, mask=mask3, other=0)
    mid = tl.load(at + 4, mask=mask3, other=0)
    high = tl.load(at + 8, mask=mask3, other=0)
    return low, mid, high, _f16(WH, row // 2, (meta // 2 + u // 4 * 8 + 6)[:, None] + i[None, :], mask)


@triton.jit
def _k_scales(low, mid, high, d_dmin, u):
    """``a = d * scale`` (x 1/16 for the high nibbles' sub-block) and ``b = -dmin * min``
    [BLOCK_N, NU, 2] from ``_k_meta``."""
    low, mid, high = low.to(tl.int32), mid.to(tl.int32), high.to(tl.int32)
    first = (u % 4 < 2)[None, :, None]
    scale = tl.where(first, low & 63, (high & 15) | ((low >> 6) << 4)).to(tl.float32)
    minimum = tl.where(first, mid & 63, (high >> 4) | ((mid >> 6) << 4)).to(tl.float32)
    d, dmin = tl.split(d_dmin.to(tl.float32))
    i = tl.arange(0, 2)
    return d[:, :, None] * scale * tl.where(i == 0, 1.0, 0.0625)[None, None, :], -dmin[:, :, None] * minimum


@triton.jit
def _k4_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N: tl.constexpr, NU: tl.constexpr,
              FIVE_BITS: tl.constexpr, WAIT: tl.constexpr):
    """Q4_K/Q5_K, ``d * scale * q - dmin * min`` per 32-wide sub-block. Unit c of a super-block: its
    32 bytes ``qs[32c:32c + 32]``, sub-block 2c in the low nibbles, 2c + 1 in the high ones; Q5_K's
    fifth bits of lanes 16h + k in bits 2k (sub-block 2c) and 2k + 1 of the unit's word h
    (``_q5_k_fifth_bits``): a thread's 16 lanes in one word, each lane's bits at a constant shift."""
    u = u0 + tl.arange(0, NU)
    mask = n_mask[:, None] & (u < hi)[None, :]
    q = _lanes(W, row, 0, u0, hi, n_mask, BLOCK_N, NU, 32)
    octet = tl.arange(0, 4)
    if FIVE_BITS:
        at = (nblocks * 128 + u * 8)[None, :, None, None] + (4 * tl.arange(0, 2))[None, None, :, None] + octet
        words = tl.load(W + row[:, None, None, None] + at, mask=mask[:, :, None, None], other=0)
        low, mid, high, d_dmin = _k_meta(W, WH, row, nblocks * 160, u, mask)
    else:
        low, mid, high, d_dmin = _k_meta(W, WH, row, nblocks * 128, u, mask)
    pdl_wait(WAIT)
    if FIVE_BITS:
        words = tl.sum(words.to(tl.int32) << 8 * octet, 3)[:, :, :, None, None]  # [BLOCK_N, NU, h, 1, 1]
        k = tl.arange(0, 16)[None, None, None, :, None]
        p = tl.arange(0, 2)[None, None, None, None, :]
        q = q.to(tl.int32)
        nibbles = tl.reshape(tl.join(q & 15, q & 240), [BLOCK_N, NU, 2, 16, 2])
        codes = nibbles | (((words >> (2 * k + p)) & 1) << (4 + 4 * p))
        f = _codes(tl.reshape(codes, [BLOCK_N, NU, 32, 2]), magic, 0)
    else:
        f = _nibble_planes(q, magic, 0)
    a, b = _k_scales(low, mid, high, d_dmin, u)
    return f, a, b


@triton.jit
def _q6_k_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N: tl.constexpr, NU: tl.constexpr,
                WAIT: tl.constexpr):
    """Q6_K, ``d * scale * (q - 32)`` per 16-wide run. Unit (half h, quarter t) of a super-block,
    lane j, run r: column ``h * 128 + r * 32 + t * 16 + j``, low four bits in byte j of the unit's
    ``ql_lo`` (runs 0, 2: low, high nibble) or ``ql_hi`` (runs 1, 3), top two in bits 2r of its
    ``qh``; its four int8 scales side by side."""
    u = u0 + tl.arange(0, NU)
    mask = n_mask[:, None] & (u < hi)[None, :]
    r = tl.arange(0, 4)
    low = _lanes(W, row, 0, u0, hi, n_mask, BLOCK_N, NU, 16)
    high = _lanes(W, row, nblocks * 64, u0, hi, n_mask, BLOCK_N, NU, 16)
    qh = _lanes(W, row, nblocks * 128, u0, hi, n_mask, BLOCK_N, NU, 16)
    scale = tl.load(W + row[:, None, None] + (nblocks * 192 + u * 4)[None, :, None] + r[None, None, :],
                    mask=mask[:, :, None], other=0)
    d = _f16(WH, row // 2, nblocks * 104 + u // 4, mask)
    pdl_wait(WAIT)
    low, high, qh = low.to(tl.int32), high.to(tl.int32), qh.to(tl.int32)
    run0 = _codes((low & 15) | ((qh & 3) << 4), magic, 32)
    run1 = _codes((high & 15) | ((qh & 12) << 2), magic, 32)
    run2 = _codes((low & 240) | ((qh & 48) << 4), magic, 512)  # 16x, as the high nibble lies
    run3 = _codes((high & 240) | ((qh & 192) << 2), magic, 512)
    f = tl.reshape(tl.join(tl.join(run0, run2), tl.join(run1, run3)), [BLOCK_N, NU, 16, 4])
    scale = scale.to(tl.int8, bitcast=True).to(tl.float32)
    a = d.to(tl.float32)[:, :, None] * scale * tl.where(r < 2, 1.0, 0.0625)[None, None, :]
    return f, a, 0.0


@triton.jit
def _units(W, WH, row, nblocks, u0, hi, n_mask, magic, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
           NU: tl.constexpr, WAIT: tl.constexpr):
    """Codes, a and b (above) of units u0 .. u0 + NU of the rows at ``row``. FORMAT is the ggml
    type's number."""
    if FORMAT == 8:
        f, a, b = _q8_0_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N, NU, WAIT)
    elif FORMAT == 2:
        f, a, b = _q4_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N, NU, False, False, WAIT)
    elif FORMAT == 3:
        f, a, b = _q4_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N, NU, True, False, WAIT)
    elif FORMAT == 6:
        f, a, b = _q4_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N, NU, False, True, WAIT)
    elif FORMAT == 7:
        f, a, b = _q4_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N, NU, True, True, WAIT)
    elif FORMAT == 12:
        f, a, b = _k4_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N, NU, False, WAIT)
    elif FORMAT == 13:
        f, a, b = _k4_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N, NU, True, WAIT)
    else:
        tl.static_assert(FORMAT == 14, "unsupported GGUF type")
        f, a, b = _q6_k_units(W, WH, row, nblocks, u0, hi, n_mask, magic, BLOCK_N, NU, WAIT)
    return f, a, b


@triton.jit
def _unit_cols(u0, FORMAT: tl.constexpr, NU: tl.constexpr):
    """The columns [NU, LANES, PLANES] of the codes of units u0 .. u0 + NU."""
    u = u0 + tl.arange(0, NU)
    if FORMAT == 8:
        cols = (u * 32)[:, None, None] + tl.arange(0, 32)[None, :, None] + tl.zeros([1, 1, 1], tl.int32)
    elif FORMAT == 2 or FORMAT == 3 or FORMAT == 6 or FORMAT == 7:
        cols = (u * 32)[:, None, None] + tl.arange(0, 16)[None, :, None] + (16 * tl.arange(0, 2))[None, None, :]
    elif FORMAT == 12 or FORMAT == 13:
        cols = (u * 64)[:, None, None] + tl.arange(0, 32)[None, :, None] + (32 * tl.arange(0, 2))[None, None, :]
    else:
        base = u // 4 * 256 + u // 2 % 2 * 128 + u % 2 * 16
        cols = base[:, None, None] + tl.arange(0, 16)[None, :, None] + (32 * tl.arange(0, 4))[None, None, :]
    return cols


# --- the GEMV of codes read as words (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; rows of 16n bytes) ------------
# A thread's codes stay in the int32 words they are loaded in, and each is moved into the mantissa
# of a float32 whose exponent makes it ``2^e + code``: Q4 nibbles to bits 12-15 (2^e = 2048) or
# 16-19 (128) by a mask and an OR (one LOP3), a shift first serving two nibbles; Q8_0 bytes to
# bits 8-15 (2^15) by one byte permute (PRMT); Q6_K's code as two floats, its nibble's and
# ``2^e' + 16 * top``. ``2^e`` is never subtracted code by code: the GEMV takes ``d`` times the sums
# of x under each 2^e (plus the offset) off the sub-block's product, which float32 rounding leaves
# within ~2^15 / 2^24 of the sub-block's sum. A word's products are added in a chain of
# multiply-adds (``tl.sum`` over a tile's lanes adds in a tree: a multiply and half an add more a
# code), and x is read in its rows' order, bfloat16 four columns a load, not gathered through
# shared memory; its conversion and sums are shared by the rows a thread holds (``uses_words``:
# where this counts fewer instructions). Main loop on sm_90 (SASS, Llama-3.1-8B's qkv, batch 1,
# ``_units`` then these): Q4_0 327 -> 292 instructions (32 rows a program: 2 rows, 64 codes a
# thread), 589 -> 460 (64 rows reducing once: 4 rows, 128 codes); Q8_0 209 -> 173, 349 -> 261;
# Q4_K 402 -> 411 (1 row a thread), 740 -> 655; Q6_K 1,056 -> 1,055, 2,202 -> 1,740.


@triton.jit
def _q8_codes(w, exponent, PTX: tl.constexpr):
    """The four bytes of each word of ``w`` as ``2^15 + code``: PTX, one byte permute a code (the byte
    to bits 8-15 beside ``exponent``'s top byte and zeros); else a shift and a mask."""
    if PTX:
        return tl.inline_asm_elementwise(
            """{
            prmt.b32 $0, $4, $5, 0x7404;
            prmt.b32 $1, $4, $5, 0x7414;
            prmt.b32 $2, $4, $5, 0x7424;
            prmt.b32 $3, $4, $5, 0x7434;
            }""", "=r,=r,=r,=r,r,r", [w, tl.zeros_like(w) + exponent],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return (_code_floats((w << 8) & 0xFF00, exponent), _code_floats(w & 0xFF00, exponent),
            _code_floats((w >> 8) & 0xFF00, exponent), _code_floats((w >> 16) & 0xFF00, exponent))


@triton.jit
def _x_quad(X, XQ, row_x, cols, offset: tl.constexpr, QUADS: tl.constexpr):
    """x at columns ``cols + offset .. + 3`` ([NU, WORDS] each, float32). QUADS (bfloat16 x, 8-byte
    aligned rows): one 8-byte load from XQ (x as int64) and shifts; else four loads."""
    if QUADS:
        q = tl.load(XQ + row_x // 4 + (cols >> 2) + offset // 4)  # cols >> 2: the same for every row of x
        low, high = q.to(tl.int32), (q >> 32).to(tl.int32)
        return ((low << 16).to(tl.float32, bitcast=True), (low & -65536).to(tl.float32, bitcast=True),
                (high << 16).to(tl.float32, bitcast=True), (high & -65536).to(tl.float32, bitcast=True))
    at = X + row_x + cols + offset
    return (tl.load(at).to(tl.float32), tl.load(at + 1).to(tl.float32), tl.load(at + 2).to(tl.float32),
            tl.load(at + 3).to(tl.float32))


@triton.jit
def _products(c0, x0, c1, x1, c2, x2, c3, x3):
    """``c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3`` added in that order, one chain of multiply-adds
    (codes [BLOCK_N, NU, WORDS], x [NU, WORDS])."""
    s = c0 * x0[None]
    s += c1 * x1[None]
    s += c2 * x2[None]
    s += c3 * x3[None]
    return s


@triton.jit
def _more_products(s, c0, x0, c1, x1, c2, x2, c3, x3):
    """``s`` plus four more products, the chain going on."""
    s += c0 * x0[None]
    s += c1 * x1[None]
    s += c2 * x2[None]
    s += c3 * x3[None]
    return s


@triton.jit
def _word_row(X, XQ, row_x, cols, c0, c1, c2, c3, c4, c5, c6, c7, d, m, d2, m2, FORMAT: tl.constexpr,
              QUADS: tl.constexpr):
    """One row of x times a step's units: ``[BLOCK_N, NU]``, from ``_word_step``'s codes. The
    products of a word's codes are added in one chain (a multiply-add each), the words' sums then;
    ``2^e`` (and the offset, the minimum) come back as ``d`` (``m``) times sums of x; Q4_K: ``d``,
    ``m`` the low nibbles' sub-block's, ``d2``, ``m2`` the high ones'. ``cols``: the units' columns,
    clamped to the row (a unit past it has d = 0)."""
    if FORMAT == 8:
        x0, x1, x2, x3 = _x_quad(X, XQ, row_x, cols, 0, QUADS)
        s = _products(c0, x0, c1, x1, c2, x2, c3, x3)
        sum_x = tl.sum(x0 + x1 + x2 + x3, 1)
        t = d * (tl.sum(s, 2) - (32768.0 + 128.0) * sum_x[None])  # codes stored as q + 128
    elif FORMAT == 12:
        x0, x2, x4, x6 = _x_quad(X, XQ, row_x, cols, 0, QUADS)  # low nibble k: column k // 2
        x1, x3, x5, x7 = _x_quad(X, XQ, row_x, cols, 32, QUADS)  # high: 32 + k // 2
        s = _products(c0, x0, c2, x2, c4, x4, c6, x6)
        s2 = _products(c1, x1, c3, x3, c5, x5, c7, x7)
        low_12, low_16 = tl.sum(x0, 1)[None], tl.sum(x2 + x4 + x6, 1)[None]  # under 2^11, 2^7
        high_12, high_16 = tl.sum(x1 + x3 + x5, 1)[None], tl.sum(x7, 1)[None]
        t = (d * (tl.sum(s, 2) - 2048.0 * low_12 - 128.0 * low_16) + m * (low_12 + low_16)
             + d2 * (tl.sum(s2, 2) - 2048.0 * high_12 - 128.0 * high_16) + m2 * (high_12 + high_16))
    else:
        x0, x2, x4, x6 = _x_quad(X, XQ, row_x, cols, 0, QUADS)  # nibble k: column k // 2 (+ 16 for odd k)
        x1, x3, x5, x7 = _x_quad(X, XQ, row_x, cols, 16, QUADS)
        s = _more_products(_products(c0, x0, c1, x1, c2, x2, c3, x3), c4, x4, c5, x5, c6, x6, c7, x7)
        high = tl.sum(x0 + x1 + x3 + x5, 1)  # the codes under 2^11
        low = tl.sum(x2 + x4 + x6 + x7, 1)  # under 2^7
        if FORMAT == 3:
            t = d * (tl.sum(s, 2) - 2048.0 * high[None] - 128.0 * low[None]) + m * (high + low)[None]
        else:
            t = d * (tl.sum(s, 2) - 2056.0 * high[None] - 136.0 * low[None])  # 2^e + 8
    return t


@triton.jit
def _word_cols(u0, units, FORMAT: tl.constexpr, NU: tl.constexpr):
    """The columns [NU, WORDS] of the first code of each word of units u0 .. u0 + NU (a unit past the
    row: the last one's, its d being 0): word i at 4i from the unit's first column."""
    u = tl.minimum(u0 + tl.arange(0, NU), units - 1)[:, None]
    if FORMAT == 14:  # of the unit's first run
        cols = u // 4 * 256 + u // 2 % 2 * 128 + u % 2 * 16 + 4 * tl.arange(0, 4)[None, :]
    elif FORMAT == 2 or FORMAT == 3:
        cols = 32 * u + 4 * tl.arange(0, 4)[None, :]
    elif FORMAT == 12:
        cols = 64 * u + 4 * tl.arange(0, 8)[None, :]
    else:
        cols = 32 * u + 4 * tl.arange(0, 8)[None, :]
    return cols


@triton.jit
def _word_step(W, WI, WH, X, XQ, m_rows, M, stride_xm, row_words, row, nblocks, u0, hi, n_mask, magic, cols,
               FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NU: tl.constexpr,
               ACC_2D: tl.constexpr, QUADS: tl.constexpr, PTX: tl.constexpr, WAIT: tl.constexpr):
    """A GEMV step over units u0 .. u0 + NU of the rows at word offsets ``row_words`` of WI (the
    planar rows as int32; byte offsets ``row``), ``cols`` the columns [NU, WORDS] of the units'
    words' first codes: ``[BLOCK_N, NU]`` (ACC_2D, one row of x) or ``[BLOCK_M, BLOCK_N]``.
    Q8_0: 8 words a unit, codes at bits 8k (columns + k). Q4_0/Q4_1: 4 words, nibble k of word i the
    code of column 4i + k // 2 (+ 16 for odd k). Q4_K: 8 words, the same with + 32, the low and high
    nibbles two sub-blocks with their own scales and minimums."""
    if FORMAT == 14:
        return _q6_step(WI, WH, X, XQ, m_rows, M, stride_xm, row_words, row, nblocks, u0, hi, n_mask, magic, cols,
                        BLOCK_M, BLOCK_N, NU, ACC_2D, QUADS, WAIT)
    u = u0 + tl.arange(0, NU)
    mask = n_mask[:, None] & (u < hi)[None, :]
    d2, minimum2 = 0.0, 0.0
    if FORMAT == 8:
        w = _lanes(WI, row_words, 0, u0, hi, n_mask, BLOCK_N, NU, 8)
        d = _f16(WH, row // 2, nblocks * 16 + u, mask)
        pdl_wait(WAIT)
        c0, c1, c2, c3 = _q8_codes(w, magic - (8 << 23), PTX)  # 2^15: a code in bits 8-15
        c4, c5, c6, c7, minimum = c0, c0, c0, c0, 0.0
        d = d.to(tl.float32)
    else:
        if FORMAT == 12:
            w = _lanes(WI, row_words, 0, u0, hi, n_mask, BLOCK_N, NU, 8)
            low, mid, high, d_dmin = _k_meta(W, WH, row, nblocks * 128, u, mask)
        else:
            w = _lanes(WI, row_words, 0, u0, hi, n_mask, BLOCK_N, NU, 4)
            d = _f16(WH, row // 2, nblocks * 8 + u, mask)
            if FORMAT == 3:
                minimum = _f16(WH, row // 2, nblocks * 9 + u, mask).to(tl.float32)
            else:
                minimum = 0.0
        pdl_wait(WAIT)
        c0, c1, c2, c3, c4, c5, c6, c7 = _nibble_codes(w, magic)
        if FORMAT == 12:  # sub-block 2c in the low nibbles, 2c + 1 in the high ones (x 16 in _k_scales)
            a, b = _k_scales(low, mid, high, d_dmin, u)
            d, d2 = tl.split(a)
            minimum, minimum2 = tl.split(b)
            d2 = d2 * 16.0
        else:
            d = d.to(tl.float32)
    if ACC_2D:
        tl.static_assert(BLOCK_M == 1, "ACC_2D takes one row of x")
        acc = _word_row(X, XQ, 0, cols, c0, c1, c2, c3, c4, c5, c6, c7, d, minimum, d2, minimum2, FORMAT, QUADS)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i in tl.static_range(BLOCK_M):
            t = _word_row(X, XQ, tl.minimum(i, M - 1) * stride_xm, cols, c0, c1, c2, c3, c4, c5, c6, c7, d, minimum,
                          d2, minimum2, FORMAT, QUADS)  # rows past M: computed, never stored
            acc += tl.where((m_rows == i)[:, None], tl.sum(t, 1)[None, :], 0.0)
    return acc


@triton.jit
def _q6_step(WI, WH, X, XQ, m_rows, M, stride_xm, row_words, row, nblocks, u0, hi, n_mask, magic, cols,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NU: tl.constexpr, ACC_2D: tl.constexpr,
             QUADS: tl.constexpr, WAIT: tl.constexpr):
    """``_word_step`` for Q6_K: a unit's ``ql_lo``, ``ql_hi`` and ``qh`` planes as 4 words each (lane
    4i + b in byte b of word i) and its four int8 scales as one word. A code ``nibble + 16 * top`` is
    two floats, ``2^e + nibble`` (``_nibble_codes``) and ``2^e' + 16 * top`` (``_q6_tops``), both
    multiplied by x in a run's chain."""
    u = u0 + tl.arange(0, NU)
    mask = n_mask[:, None] & (u < hi)[None, :]
    lo = _lanes(WI, row_words, 0, u0, hi, n_mask, BLOCK_N, NU, 4)
    hi_words = _lanes(WI, row_words, nblocks * 16, u0, hi, n_mask, BLOCK_N, NU, 4)
    qh = _lanes(WI, row_words, nblocks * 32, u0, hi, n_mask, BLOCK_N, NU, 4)
    scales = tl.load(WI + row_words[:, None] + (nblocks * 48 + u)[None, :], mask=mask, other=0)
    d = _f16(WH, row // 2, nblocks * 104 + u // 4, mask)
    pdl_wait(WAIT)
    # runs 0 and 2 in ql_lo's low and high nibbles, 1 and 3 in ql_hi's; byte b: nibble 2b, 2b + 1
    l0, l1, l2, l3, l4, l5, l6, l7 = _nibble_codes(lo, magic)
    h0, h1, h2, h3, h4, h5, h6, h7 = _nibble_codes(hi_words, magic)
    t00, t01, t02, t03, t10, t11, t12, t13, t20, t21, t22, t23, t30, t31, t32, t33 = _q6_tops(qh, magic)
    d = d.to(tl.float32)
    a0 = d * ((scales << 24) >> 24).to(tl.float32)  # int8 scale r: byte r, sign-extended
    a1 = d * ((scales << 16) >> 24).to(tl.float32)
    a2 = d * ((scales << 8) >> 24).to(tl.float32)
    a3 = d * (scales >> 24).to(tl.float32)
    if ACC_2D:
        tl.static_assert(BLOCK_M == 1, "ACC_2D takes one row of x")
        acc = _q6_row(X, XQ, 0, cols, l0, l1, l2, l3, l4, l5, l6, l7, h0, h1, h2, h3, h4, h5, h6, h7, t00, t01, t02,
                      t03, t10, t11, t12, t13, t20, t21, t22, t23, t30, t31, t32, t33, a0, a1, a2, a3, QUADS)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i in tl.static_range(BLOCK_M):
            t = _q6_row(X, XQ, tl.minimum(i, M - 1) * stride_xm, cols, l0, l1, l2, l3, l4, l5, l6, l7, h0, h1, h2, h3,
                        h4, h5, h6, h7, t00, t01, t02, t03, t10, t11, t12, t13, t20, t21, t22, t23, t30, t31, t32, t33,
                        a0, a1, a2, a3, QUADS)
            acc += tl.where((m_rows == i)[:, None], tl.sum(t, 1)[None, :], 0.0)
    return acc


@triton.jit
def _q6_tops(qh, magic):
    """The 2-bit fields of each word of ``qh`` (byte b, run r at bits 8b + 2r) as ``2^e + 16 * top``,
    in order (b, r): each moved to bits 14-21 (at 14 + 2j: 2^e = 2^(13 - 2j)) by one LOP3, four
    shifts serving the sixteen."""
    e14 = magic - (10 << 23)  # a field at bit p under 2^(27 - p): 2^(27 - p) + 16 * field
    e16 = magic - (12 << 23)
    e18 = magic - (14 << 23)
    e20 = magic - (16 << 23)
    b1, b0, b3 = qh << 6, qh << 14, qh >> 8
    return (_code_floats(b0 & 0xC000, e14), _code_floats(b0 & 0x30000, e16), _code_floats(b0 & 0xC0000, e18),
            _code_floats(b0 & 0x300000, e20),
            _code_floats(b1 & 0xC000, e14), _code_floats(b1 & 0x30000, e16), _code_floats(b1 & 0xC0000, e18),
            _code_floats(b1 & 0x300000, e20),
            _code_floats(qh & 0x30000, e16), _code_floats(qh & 0xC0000, e18), _code_floats(qh & 0x300000, e20),
            _code_floats(b3 & 0xC000, e14),
            _code_floats(b3 & 0x30000, e16), _code_floats(b3 & 0xC0000, e18), _code_floats(b3 & 0x300000, e20),
            _code_floats((qh >> 16) & 0xC000, e14))


@triton.jit
def _q6_run(X, XQ, row_x, cols, n0, n1, n2, n3, t0, t1, t2, t3, c0: tl.constexpr, c1: tl.constexpr,
            c2: tl.constexpr, c3: tl.constexpr, QUADS: tl.constexpr):
    """A Q6_K run's ``sum (code - 32) * x`` over a unit's 16 lanes [BLOCK_N, NU] from its nibble floats
    n_b and top floats t_b (byte b of each word), ``c_b`` the 2^e of both plus 32."""
    x0, x1, x2, x3 = _x_quad(X, XQ, row_x, cols, 0, QUADS)
    s = _more_products(_products(n0, x0, t0, x0, n1, x1, t1, x1), n2, x2, t2, x2, n3, x3, t3, x3)
    offsets = c0 * tl.sum(x0, 1) + c1 * tl.sum(x1, 1) + c2 * tl.sum(x2, 1) + c3 * tl.sum(x3, 1)
    return tl.sum(s, 2) - offsets[None]


@triton.jit
def _q6_row(X, XQ, row_x, cols, l0, l1, l2, l3, l4, l5, l6, l7, h0, h1, h2, h3, h4, h5, h6, h7, t00, t01, t02, t03,
            t10, t11, t12, t13, t20, t21, t22, t23, t30, t31, t32, t33, a0, a1, a2, a3, QUADS: tl.constexpr):
    """One row of x times a step's Q6_K units: ``[BLOCK_N, NU]``. Run r's columns: ``cols + 32 r``;
    the 2^e of each lane's two floats (``_nibble_codes``, ``_q6_tops``) plus 32 are taken off as
    sums of x."""
    run0 = _q6_run(X, XQ, row_x, cols, l0, l2, l4, l6, t00, t10, t20, t30, 2048.0 + 8192.0 + 32.0,
                   128.0 + 8192.0 + 32.0, 128.0 + 2048.0 + 32.0, 128.0 + 2048.0 + 32.0, QUADS)
    run1 = _q6_run(X, XQ, row_x, cols + 32, h0, h2, h4, h6, t01, t11, t21, t31, 2048.0 + 2048.0 + 32.0,
                   128.0 + 2048.0 + 32.0, 128.0 + 512.0 + 32.0, 128.0 + 512.0 + 32.0, QUADS)
    run2 = _q6_run(X, XQ, row_x, cols + 64, l1, l3, l5, l7, t02, t12, t22, t32, 2048.0 + 512.0 + 32.0,
                   2048.0 + 512.0 + 32.0, 2048.0 + 128.0 + 32.0, 128.0 + 128.0 + 32.0, QUADS)
    run3 = _q6_run(X, XQ, row_x, cols + 96, h1, h3, h5, h7, t03, t13, t23, t33, 2048.0 + 128.0 + 32.0,
                   2048.0 + 128.0 + 32.0, 2048.0 + 8192.0 + 32.0, 128.0 + 8192.0 + 32.0, QUADS)
    return a0 * run0 + a1 * run1 + a2 * run2 + a3 * run3


@triton.jit
def _nibble_codes(w, magic):
    """The eight nibbles of each word of ``w`` as ``2^e + code``, nibble k (bits 4k-4k+3) moved to bits
    12-15 (2^e = 2048: k = 0, 1, 3, 5) or 16-19 (128: k = 2, 4, 6, 7), two nibbles a shift."""
    e12 = magic - (12 << 23)  # 2^11
    e16 = magic - (16 << 23)  # 2^7
    left, right = w << 8, w >> 8
    return (_code_floats((w << 12) & 0xF000, e12), _code_floats(left & 0xF000, e12),
            _code_floats(left & 0xF0000, e16), _code_floats(w & 0xF000, e12), _code_floats(w & 0xF0000, e16),
            _code_floats(right & 0xF000, e12), _code_floats(right & 0xF0000, e16),
            _code_floats((w >> 12) & 0xF0000, e16))


@triton.jit
def _weights(f, a, b, HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile's weights [BLOCK_N, BLOCK_K] (float32), columns in the order of its codes'."""
    w = a[:, :, None, :] * f
    if HAS_MIN:
        w += b[:, :, None, :]
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


# --- the matmuls -----------------------------------------------------------------------------


@triton.jit
def _dequantize_kernel(W, WH, OUT, N, K, row_bytes, nblocks, units, magic, FORMAT: tl.constexpr,
                       HAS_MIN: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, NU: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program: rows [BLOCK_N] x units [NU] of the planar rows at W, decoded into OUT ``[N, K]``
    (OUT's dtype, row-major); its loads go out before ``pdl_wait`` (in ``_units``). Q8_0, Q4_0,
    Q4_1, Q5_0 and Q5_1 tiles are put in column order before they are stored, so that each thread
    writes runs of adjacent columns: in code order a Q4 unit's neighbouring values are 16 columns apart, and the
    pass wrote at ~0.16 TB/s on an H200 (docs/benchmarks.md, "second run"). The K-quants keep code
    order: the reordering took Q4_K from 121 registers to 218 and Q5_K from 167 to 255 (sm_90,
    ``benchmarks/triton_sm90.py``), and none of it is measured on a GPU yet."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    u0 = tl.program_id(1) * NU
    f, a, b = _units(W, WH, _row_offsets(n, row_bytes, ROW_ALIGN), nblocks, u0, units, n_mask, magic, FORMAT,
                     BLOCK_N, NU, PDL)
    if FORMAT == 12 or FORMAT == 13 or FORMAT == 14:
        w = _weights(f, a, b, HAS_MIN, BLOCK_N, BLOCK_K)
        cols = tl.reshape(_unit_cols(u0, FORMAT, NU), [BLOCK_K])
    else:
        w = a[:, :, None, :] * f  # [BLOCK_N, NU, lanes, planes]: column u * 32 + plane * 16 + lane
        if HAS_MIN:
            w += b[:, :, None, :]
        w = tl.reshape(tl.permute(w, (0, 1, 3, 2)), [BLOCK_N, BLOCK_K])
        cols = u0 * (BLOCK_K // NU) + tl.arange(0, BLOCK_K)
    tl.store(OUT + n.to(tl.int64)[:, None] * K + cols[None, :], w.to(OUT.dtype.element_ty),
             mask=n_mask[:, None] & (cols < K)[None, :])


@triton.jit
def _row_offsets(n, row_bytes, ROW_ALIGN: tl.constexpr):
    """Byte offsets (int64) of rows ``n``, ``row_bytes`` being a multiple of ROW_ALIGN: written so
    that the compiler knows it, and loads that many bytes at a time."""
    return n.to(tl.int64) * (row_bytes // ROW_ALIGN) * ROW_ALIGN


@triton.jit
def _gemv_x(X, i, stride_xm, K, cols):
    """Row i of x at ``cols``, in float32."""
    return tl.load(X + i * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _gemv_products(X, m, M, stride_xm, K, f, a, b, cols, HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr,
                   ACC_2D: tl.constexpr):
    """A GEMV tile's products with the rows of x, a thread's lanes summed in registers: ACC_2D (one
    row of x), per sub-block ``[BLOCK_N, NU, PLANES]``; else summed over the tile ``[BLOCK_M,
    BLOCK_N]``, a row of x at a time, so a thread holds one row's columns of its codes."""
    if ACC_2D:
        tl.static_assert(BLOCK_M == 1, "ACC_2D takes one row of x")
        acc = _gemv_row(_gemv_x(X, 0, stride_xm, K, cols), f, a, b, HAS_MIN)
    else:
        acc = tl.zeros([BLOCK_M, f.shape[0]], tl.float32)
        for i in tl.static_range(BLOCK_M):
            x = _gemv_x(X, tl.minimum(i, M - 1), stride_xm, K, cols)  # rows past M: computed, never stored
            acc += tl.where((m == i)[:, None], tl.sum(tl.sum(_gemv_row(x, f, a, b, HAS_MIN), 2), 1)[None, :], 0.0)
    return acc


@triton.jit
def _gemv_row(x, f, a, b, HAS_MIN: tl.constexpr):
    """Products ``[BLOCK_N, NU, PLANES]`` of a tile with x's tile, summed over each sub-block's lanes."""
    t = a * tl.sum(f * x[None], 2)
    if HAS_MIN:
        t += b * tl.sum(x, 1)[None]
    return t


@triton.jit
def _gemv_kernel(W, WI, WH, X, XQ, Y, BIAS, M, N, K, row_bytes, row_words, nblocks, units, units_per_split, stride_xm,
                 stride_ym, stride_ys, magic, FORMAT: tl.constexpr, HAS_MIN: tl.constexpr, ROW_ALIGN: tl.constexpr,
                 BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, NU: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 ACC_2D: tl.constexpr, WORDS: tl.constexpr, QUADS: tl.constexpr, PTX: tl.constexpr,
                 PDL: tl.constexpr):
    """One program: BLOCK_N output rows, every row of x, the units of one split of K, NU a step.
    Split, it writes float32 partial sums ``Y[split]``; else the result (+ bias) in Y's dtype. The
    first tile's loads go out before ``pdl_wait`` (in ``_units``): no kernel writes weights. WORDS:
    codes decoded from the words they are loaded in (``_word_step``; WI the rows as int32)."""
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    row = _row_offsets(n, row_bytes, ROW_ALIGN)
    m = tl.arange(0, BLOCK_M)
    lo = split * units_per_split
    hi = tl.minimum(lo + units_per_split, units)
    if WORDS:
        words = n.to(tl.int64) * (row_words // 4) * 4  # rows of 16-byte multiples: aligned, so read 16 bytes a load
        acc = _word_step(W, WI, WH, X, XQ, m, M, stride_xm, words, row, nblocks, lo, hi, n_mask, magic,
                         _word_cols(lo, units, FORMAT, NU), FORMAT, BLOCK_M, BLOCK_N, NU, ACC_2D, QUADS, PTX, PDL)
        for u0 in range(lo + NU, hi, NU):
            acc += _word_step(W, WI, WH, X, XQ, m, M, stride_xm, words, row, nblocks, u0, hi, n_mask, magic,
                              _word_cols(u0, units, FORMAT, NU), FORMAT, BLOCK_M, BLOCK_N, NU, ACC_2D, QUADS, PTX,
                              False)
        if ACC_2D:
            acc = tl.sum(acc, 1)[None, :]
    else:
        f, a, b = _units(W, WH, row, nblocks, lo, hi, n_mask, magic, FORMAT, BLOCK_N, NU, PDL)
        acc = _gemv_products(X, m, M, stride_xm, K, f, a, b, _unit_cols(lo, FORMAT, NU), HAS_MIN, BLOCK_M, ACC_2D)
        for u0 in range(lo + NU, hi, NU):
            f, a, b = _units(W, WH, row, nblocks, u0, hi, n_mask, magic, FORMAT, BLOCK_N, NU, False)
            acc += _gemv_products(X, m, M, stride_xm, K, f, a, b, _unit_cols(u0, FORMAT, NU), HAS_MIN, BLOCK_M,
                                  ACC_2D)
        if ACC_2D:
            acc = tl.sum(tl.sum(acc, 2), 1)[None, :]
    store_gemv_rows(acc, Y, BIAS, m, n, m < M, n_mask, split, stride_ym, stride_ys, HAS_BIAS, SPLIT)


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
def _gemm_kernel(W, WH, X, Y, BIAS, M, N, K, row_bytes, nblocks, units, stride_xm, stride_ym, magic,
                 FORMAT: tl.constexpr, HAS_MIN: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, NU: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """One program: a [BLOCK_M, BLOCK_N] tile of Y. Axis 0 walks M, so programs reading the same
    weight rows are launched together."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    row = _row_offsets(n, row_bytes, ROW_ALIGN)
    x_rows = X + m.to(tl.int64)[:, None] * stride_xm
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for u0 in range(0, units, NU):
        f, a, b = _units(W, WH, row, nblocks, u0, units, n_mask, magic, FORMAT, BLOCK_N, NU, False)
        cols = tl.reshape(_unit_cols(u0, FORMAT, NU), [BLOCK_K])
        x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :], other=0.0)
        w = _weights(f, a, b, HAS_MIN, BLOCK_N, BLOCK_K).to(x.dtype)
        if DOT_F32:  # the interpreter's half-precision dot is wrong: same rounding, float32 product
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# --- launchers -------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off the GPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def gemv_splits(row_programs: int, units: int, units_per_step: int, num_sms: int) -> int:
    """K splits for a GEMV of ``row_programs`` programs per split: about PROGRAMS_PER_SM programs
    per SM in all, no split shorter than 4 steps."""
    want = -(-PROGRAMS_PER_SM * num_sms // row_programs)
    return max(1, min(want, units // (4 * units_per_step)))


def default_gemv_config(ggml_type: T) -> GemvConfig:
    """The GEMV's tiling when a module has none chosen (GEMV_BLOCK_N, GEMV_VECTORS, 4 warps)."""
    return _gemv_config(ggml_type, GEMV_BLOCK_N, GEMV_VECTORS, 4, GEMV_ACC_2D)


def _gemv_config(ggml_type: T, block_n: int, vectors: int, num_warps: int, acc_2d: bool) -> GemvConfig:
    """A tiling of ``block_n`` rows and ``vectors`` 16-byte vectors of codes a row a step, K split
    by ``gemv_splits``."""
    layout = LAYOUTS[ggml_type]
    units = max(1, vectors // (layout.lanes // 16))
    return GemvConfig(block_n, units * layout.unit_cols, None, acc_2d, num_warps)


# Tilings worth timing besides the default, (rows a program, vectors a row a step, warps): a thread
# covers rows x vectors / threads rows, 1 to 4, which share the columns of x it reads; more rows
# or vectors a program put more bytes in flight, fewer rows leave more programs before K splits.
GEMV_TILINGS = ((16, 8, 4), (64, 8, 4), (32, 16, 4), (16, 16, 4), (8, 32, 4), (64, 8, 8), (32, 16, 8), (64, 16, 8))


def gemv_candidates(ggml_type: T, n: int, k: int, device: torch.device) -> list[GemvConfig]:
    """The GEMV tilings worth timing on a Hopper GPU for an ``n x k`` weight of ``ggml_type`` at
    batch 1, at most 12, the default first: the default at both accumulations and at half its K
    splits and none (the splits' partial sums and second launch may cost more than the programs
    they add), then GEMV_TILINGS reducing once (``acc_2d``), each with ``gemv_splits``' splits."""
    default = default_gemv_config(ggml_type)
    candidates = [default, replace(default, acc_2d=not default.acc_2d)]
    units = k // LAYOUTS[ggml_type].unit_cols
    auto = gemv_splits(triton.cdiv(n, default.block_n), units, _gemv_units(default, LAYOUTS[ggml_type], units),
                       num_sms(device))
    candidates += [replace(default, splits=splits) for splits in sorted({max(1, auto // 2), 1} - {auto}, reverse=True)]
    candidates += [_gemv_config(ggml_type, *tiling, True) for tiling in GEMV_TILINGS]
    return list(dict.fromkeys(candidates))[:12]


def uses_words(ggml_type: T, m: int, row_bytes: int, config: GemvConfig, nu: int) -> bool:
    """Whether the GEMV of ``m`` rows of x decodes codes from words (``_word_step``), where its main
    loop has fewer instructions than decoding bytes (sm_90 SASS, docs/gpu.md): rows of a multiple
    of 16 bytes (else the compiler, unsure of their alignment, loads a word at a time and spreads a
    unit's words over threads: Q6_K's sums became shuffles), at most WORD_MAX_ROWS rows of x (each
    row's x costs the words a conversion and sums of its own: 8 rows of Q4_0 took 1,447
    instructions against 1,264); the K-quants only at one row of x and tilings of two or more
    (row, unit) pairs a thread (with one, the sums of x cost what the words save: Q4_K 411 against
    402; Q6_K's default, two units of one row, 1,055 against 1,056)."""
    if ggml_type not in WORD_TYPES or row_bytes % 16 or m > WORD_MAX_ROWS:
        return False
    return ggml_type not in (T.Q4_K, T.Q6_K) or (m == 1 and config.block_n * nu >= 2 * 32 * config.num_warps)


def _gemv_units(config: GemvConfig, layout: BlockLayout, units: int) -> int:
    """Units a GEMV step: ``config.block_k`` columns rounded down to a power of two of units (at
    least one), at most the row's units rounded up."""
    nu = max(1, config.block_k // layout.unit_cols)
    return min(1 << (nu.bit_length() - 1), triton.next_power_of_2(units))


def _weight_args(blocks: torch.Tensor, ggml_type: T, k: int) -> dict:
    """The weight arguments every kernel takes: planar rows as bytes and as float16 (the scale
    planes' loads), row bytes, blocks and units a row, MAGIC."""
    layout = LAYOUTS[ggml_type]
    row_bytes = blocks.shape[1]
    return dict(W=blocks, WH=blocks.view(torch.float16), row_bytes=row_bytes, nblocks=k // layout.block_cols,
                units=k // layout.unit_cols, magic=MAGIC, FORMAT=int(ggml_type), HAS_MIN=layout.has_min,
                ROW_ALIGN=min(16, row_bytes & -row_bytes))


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: T, bias: torch.Tensor | None = None,
                config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ dequant(blocks)^T (+ bias)``: ``x`` ``[M, K]`` float (unit stride along K), ``blocks``
    the planar rows (``planar``) ``uint8 [N, K / block_cols * block_bytes]`` of ``ggml_type`` (one
    of ``GPU_TYPES``), ``bias`` ``[N]``; returns ``[M, N]`` in ``x``'s dtype. ``config`` tiles the
    GEMV (M <= GEMV_MAX_ROWS; None: ``default_gemv_config``)."""
    layout = LAYOUTS[ggml_type]
    m, k = x.shape
    n, row_bytes = blocks.shape
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous() and x.stride(1) == 1
    assert k % layout.block_cols == 0 and row_bytes == k // layout.block_cols * layout.block_bytes, \
        f"{ggml_type.name} blocks {tuple(blocks.shape)} do not hold {k} columns"
    if m > GEMM_MAX_ROWS:
        return _dequantized_matmul(x, blocks, ggml_type, bias)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    bias = out if bias is None else bias
    weight = _weight_args(blocks, ggml_type, k)
    if m > GEMV_MAX_ROWS:
        block_m = min(max(triton.next_power_of_2(m), 16), 64)
        nu = max(1, GEMM_BLOCK_K // layout.unit_cols)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, GEMM_BLOCK_N))
        _gemm_kernel[grid](X=x, Y=out, BIAS=bias, M=m, N=n, K=k, stride_xm=x.stride(0), stride_ym=out.stride(0),
                           BLOCK_M=block_m, BLOCK_N=GEMM_BLOCK_N, NU=nu, BLOCK_K=nu * layout.unit_cols,
                           HAS_BIAS=has_bias, DOT_F32=DOT_F32, num_warps=8, **weight, **pdl(x.device))
        return out
    config = config or default_gemv_config(ggml_type)
    block_m = triton.next_power_of_2(m)
    units = k // layout.unit_cols
    nu = _gemv_units(config, layout, units)
    row_programs = triton.cdiv(n, config.block_n)
    splits = config.splits or gemv_splits(row_programs, units, nu, num_sms(x.device))
    units_per_split = triton.cdiv(triton.cdiv(units, splits), nu) * nu
    splits = triton.cdiv(units, units_per_split)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    words = uses_words(ggml_type, m, row_bytes, config, nu)
    quads = words and x.dtype == torch.bfloat16 and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0
    _gemv_kernel[(row_programs, splits)](
        X=x, Y=target, BIAS=bias, M=m, N=n, K=k, units_per_split=units_per_split, stride_xm=x.stride(0), stride_ym=n,
        stride_ys=m * n, BLOCK_M=block_m, BLOCK_N=config.block_n, NU=nu, HAS_BIAS=has_bias, SPLIT=splits > 1,
        ACC_2D=config.acc_2d and m == 1, WI=blocks.view(torch.int32) if words else blocks, row_words=row_bytes // 4,
        WORDS=words, XQ=x.view(torch.int64) if quads else x, QUADS=quads, PTX=not kernels.INTERPRETED, num_warps=config.num_warps, **weight, **pdl(x.device))
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
    """The ``[N, k]`` weights in ``dtype`` of planar rows ``blocks`` (``uint8 [N, row bytes]``)."""
    layout = LAYOUTS[ggml_type]
    n = blocks.shape[0]
    nu = max(1, GEMM_BLOCK_K // layout.unit_cols)
    out = torch.empty(n, k, dtype=dtype, device=blocks.device)
    grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k // layout.unit_cols, nu))
    _dequantize_kernel[grid](OUT=out, N=n, K=k, BLOCK_N=DEQUANT_BLOCK_N, NU=nu, BLOCK_K=nu * layout.unit_cols,
                             num_warps=4, **_weight_args(blocks, ggml_type, k), **pdl(blocks.device))
    return out
