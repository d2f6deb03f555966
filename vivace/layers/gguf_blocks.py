"""GGUF quantized blocks read into ``QuantizedWeight``s that vivace's int2/int3/int4/int5/int6/int8 kernels
run, every one bit-exact against ``gguf.quants.dequantize`` (codes and scales as stored):

- Q8_0, Q4_0, Q4_1: groups of 32 with a float16 scale ``d`` and min (Q4_1) or zero point.
- Q5_0, Q5_1: 5-bit codes (Q5_0 with zero point 16); 5.5 and 6 bits a weight.
- Q4_K, Q5_K: 4- and 5-bit codes, the super-block's float16 ``d`` and ``-dmin`` per 256 columns,
  and each 32-wide sub-block's six-bit scale and min as int8: 4.625 and 5.625 bits a weight
  (the file's 4.5 and 5.5 pack the six-bit numbers; bytes kept whole here for the kernel).
- Q6_K: 6-bit codes (zero point 32), the super-block's float16 ``d`` per 256 columns and each
  16-wide sub-block's int8 scale: 6.5625 bits a weight, as in the file.
- Q3_K: 3-bit codes (zero point 4), ``d`` per 256 columns and each 16-wide sub-block's signed
  six-bit scale as int8: 3.5625 bits a weight (the file's 3.4375 packs the scales in six bits).
- Q2_K: 2-bit codes, ``d`` and ``-dmin`` per 256 columns and each 16-wide sub-block's four-bit
  scale and min as int8: 3.125 bits a weight (the file's 2.625 packs scale and min in a byte).
- IQ4_NL, IQ4_XS: their nibbles index a table of 16 int8 values (not evenly spaced): 4-bit codes
  as stored, with that table plus 128 as the weight's ``codebook`` (zero point 128), which the
  kernel looks each nibble up in, and a float16 scale per 32 columns: 4.5 bits a weight for both
  (the file's 4.5 and 4.25). IQ4_NL's scale is the file's; IQ4_XS's is its super-block's ``d``
  times the sub-block's six-bit scale, rounded to float16 (at most 2^-11 of it, as
  ``QuantizedWeight.grouped`` rounds Q4_K's).

Other types (the other IQ*, TQ*) have no form here: ``NATIVE_TYPES`` lists those that do.
"""

from __future__ import annotations

from typing import NamedTuple

import gguf
import numpy as np
import torch

from vivace.layers.quant_format import QuantizedWeight

T = gguf.GGMLQuantizationType
GROUP = 32
NATIVE_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)
# IQ4_NL's and IQ4_XS's code values (ggml's kvalues_iq4nl) plus 128: their codebook, with zero point 128.
IQ4_CODEBOOK = (np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.int16) + 128).astype(np.uint8)


def from_gguf_blocks(data: np.ndarray, ggml_type: gguf.GGMLQuantizationType) -> QuantizedWeight:
    """Codes and scales from GGUF block bytes ``[N, row_bytes]`` of a type in ``NATIVE_TYPES``.

    Raises ValueError for any other type. No float copy of the weight is made.
    """
    if ggml_type not in NATIVE_TYPES:
        raise ValueError(f"GGUF type {ggml_type.name} has no direct quantized form; supported: "
                         f"{', '.join(t.name for t in NATIVE_TYPES)}")
    n = data.shape[0]
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = np.array(data, dtype=np.uint8, copy=True).reshape(-1, type_size)  # the source may be a read-only map
    decoded = _READERS[ggml_type](blocks)
    bits = _BITS.get(ggml_type, 8)

    def rows(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))

    sub_group = 0 if decoded.sub_scales is None else decoded.codes.size // decoded.sub_scales.size
    codebook = torch.from_numpy(IQ4_CODEBOOK.copy()) if ggml_type in (T.IQ4_NL, T.IQ4_XS) else None
    return QuantizedWeight(rows(decoded.codes), rows(decoded.scales), rows(decoded.mins), decoded.zero_point, bits,
                           block_size if sub_group else GROUP, rows(decoded.sub_scales), rows(decoded.sub_mins),
                           sub_group, codebook)


class Decoded(NamedTuple):
    codes: np.ndarray
    scales: np.ndarray  # float16
    mins: np.ndarray | None  # float16, or None for a zero point
    zero_point: int
    sub_scales: np.ndarray | None = None  # int8, per sub-block (K-quants)
    sub_mins: np.ndarray | None = None


def _half(raw: np.ndarray) -> np.ndarray:
    """float16 values of little-endian float16 bytes ``[..., 2]``."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """A block's byte j holds element j (low nibble) and element j + len (high nibble)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of the little-endian 32-bit word ``qh`` ``[..., 4]``: element j's fifth bit (Q5_0/Q5_1)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q8_0(blocks: np.ndarray) -> Decoded:
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Decoded(codes, _half(blocks[:, :2]), None, 128)


def _q4_0(blocks: np.ndarray) -> Decoded:
    return Decoded(_nibbles(blocks[:, 2:]), _half(blocks[:, :2]), None, 8)


def _q4_1(blocks: np.ndarray) -> Decoded:
    return Decoded(_nibbles(blocks[:, 4:]), _half(blocks[:, :2]), _half(blocks[:, 2:4]), 0)


def _q5_0(blocks: np.ndarray) -> Decoded:
    codes = _nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6]) << 4)
    return Decoded(codes, _half(blocks[:, :2]), None, 16)


def _q5_1(blocks: np.ndarray) -> Decoded:
    codes = _nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8]) << 4)
    return Decoded(codes, _half(blocks[:, :2]), _half(blocks[:, 2:4]), 0)


def _k_scales(blocks: np.ndarray, codes: np.ndarray) -> Decoded:
    """Q4_K/Q5_K: float16 ``d`` and ``-dmin`` per block, six-bit scale and min per 32-wide sub-block."""
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    return Decoded(codes, _half(blocks[:, 0:2]), -_half(blocks[:, 2:4]), 0, sc.astype(np.int8), m.astype(np.int8))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: each 32 bytes hold sub-block 2i (low nibbles) and 2i + 1 (high nibbles)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)


def _q4_k(blocks: np.ndarray) -> Decoded:
    return _k_scales(blocks, _k_low_nibbles(blocks[:, 16:]))


def _q5_k(blocks: np.ndarray) -> Decoded:
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit i: sub-block i
    return _k_scales(blocks, _k_low_nibbles(blocks[:, 48:]) | ((qh & 1).reshape(-1, 256) << 4))


def _q6_k(blocks: np.ndarray) -> Decoded:
    """Each 64 bytes of ``ql`` hold 64 columns' low nibbles then 64 more's high nibbles; each 32
    bytes of ``qh`` the top two bits of four runs of 32 columns, run i in bits 2i, 2i + 1."""
    ql, qh = blocks[:, :128].reshape(-1, 2, 1, 64), blocks[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low | (high.reshape(-1, 8, 32) << 4)).reshape(-1, 256)
    return Decoded(codes, _half(blocks[:, 208:210]), None, 32, blocks[:, 192:208].view(np.int8))


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K: each 32 bytes of ``qs`` hold four runs of 32 columns, run i in bits 2i, 2i + 1."""
    runs = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (runs & 3).reshape(-1, 256)


def _q3_k(blocks: np.ndarray) -> Decoded:
    """``hmask`` bit i of byte j: the third bit of column 32i + j; the sixteen six-bit scales (stored
    plus 32) as low nibbles in bytes 0..7 (scale i in byte i % 8, bits 4 (i // 8) and up) and top
    bit pairs in bytes 8..11 (scale i's in byte 8 + i % 4, bits 2 (i // 4))."""
    high = (blocks[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes = _crumbs(blocks[:, 32:96]) | (high.reshape(-1, 256) << 2)
    low = blocks[:, 96:104].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    top = blocks[:, 104:108].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    scales = (low.reshape(-1, 16) & 0x0F) | ((top.reshape(-1, 16) & 3) << 4)
    return Decoded(codes, _half(blocks[:, 108:110]), None, 4, (scales.astype(np.int16) - 32).astype(np.int8))


def _q2_k(blocks: np.ndarray) -> Decoded:
    """Bytes 0..15: sub-block i's scale (low nibble) and min (high nibble); then the codes, ``d``, ``dmin``."""
    sc = blocks[:, :16]
    return Decoded(_crumbs(blocks[:, 16:80]), _half(blocks[:, 80:82]), -_half(blocks[:, 82:84]), 0,
                   (sc & 0x0F).astype(np.int8), (sc >> 4).astype(np.int8))


def _iq4_nl(blocks: np.ndarray) -> Decoded:
    """A float16 ``d`` and 32 nibbles in Q4_0's order, each indexing ``IQ4_CODEBOOK``."""
    return Decoded(_nibbles(blocks[:, 2:]), _half(blocks[:, :2]), None, 128)


def _iq4_xs(blocks: np.ndarray) -> Decoded:
    """Per 256 columns a float16 ``d``, a 16-bit word of the sub-blocks' top two scale bits
    (sub-block i: bits 2i, 2i + 1), four bytes of their low four (two a byte, low nibble first),
    then 128 bytes of codes, 16 a sub-block in IQ4_NL's order. A sub-block's scale is
    ``d * (ls - 32)``."""
    sub = np.arange(8)
    high = (blocks[:, 2:4].copy().view(np.uint16) >> (2 * sub).astype(np.uint16)) & 3  # [B, 8]
    low = (blocks[:, 4 + sub // 2] >> (4 * (sub % 2)).astype(np.uint8)) & 0x0F
    ls = (low | (high << 4)).astype(np.float32) - 32
    scales = (_half(blocks[:, :2]).astype(np.float32)[:, None] * ls).astype(np.float16)
    return Decoded(_nibbles(blocks[:, 8:].reshape(-1, 8, 16)).reshape(-1, 256), scales, None, 128)


_BITS = {T.Q2_K: 2, T.Q3_K: 3, T.Q4_0: 4, T.Q4_1: 4, T.Q4_K: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q6_K: 6,
         T.IQ4_NL: 4, T.IQ4_XS: 4}
_READERS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q2_K: _q2_k, T.Q3_K: _q3_k,
            T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs}
