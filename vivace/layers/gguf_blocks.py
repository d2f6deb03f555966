"""GGUF quantized blocks read into ``QuantizedWeight``s that vivace's int4/int5/int8 kernels run.

Every format becomes groups of 32 columns with one float16 scale ``d`` and either a min ``m``
(``w = d * q + m``) or a zero point z (``w = d * (q - z)``), codes kept as stored:

- Q8_0, Q4_0, Q4_1: as stored (bit-exact).
- Q5_0, Q5_1: 5-bit codes (Q5_0 with zero point 16); bit-exact, 5.5 and 6 bits a weight.
- Q4_K, Q5_K: 4- and 5-bit codes kept; each 32-wide sub-block's ``d * sc`` and ``-dmin * m``
  (six-bit integers times the super-block's float16 ``d``/``dmin``) rounded to float16:
  a relative error of at most 2^-11 on those two numbers.
- Q6_K: its sub-blocks are 16 wide, each with its own int8 scale; a group of 32 takes scale
  ``s / 4`` of its larger sub-block scale ``s``, so that sub-block's codes map exactly
  (``4 * (q - 32)`` in [-128, 124]), the other's rounded to the nearest multiple: an error of at
  most ``s / 8`` per weight, an eighth of the coarser sub-block's own step.

Other types (Q2_K, Q3_K, IQ*, TQ*) have no form here: ``NATIVE_TYPES`` lists those that do.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from vivace.layers.quant_format import QuantizedWeight

T = gguf.GGMLQuantizationType
GROUP = 32
NATIVE_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)


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
    codes, scales, mins, zero_point = _READERS[ggml_type](blocks)
    bits = 4 if ggml_type in (T.Q4_0, T.Q4_1, T.Q4_K) else 5 if ggml_type in (T.Q5_0, T.Q5_1, T.Q5_K) else 8
    return QuantizedWeight(torch.from_numpy(codes.reshape(n, -1)), torch.from_numpy(scales.reshape(n, -1)),
                           None if mins is None else torch.from_numpy(mins.reshape(n, -1)), zero_point, bits, GROUP)


Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None, int]  # codes, scales, mins, zero point


def _half(raw: np.ndarray) -> np.ndarray:
    """float32 values of little-endian float16 bytes ``[..., 2]``."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """A block's byte j holds element j (low nibble) and element j + len (high nibble)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of the little-endian 32-bit word ``qh`` ``[..., 4]``: element j's fifth bit (Q5_0/Q5_1)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q8_0(blocks: np.ndarray) -> Decoded:
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, _half(blocks[:, :2]).astype(np.float16), None, 128


def _q4_0(blocks: np.ndarray) -> Decoded:
    return _nibbles(blocks[:, 2:]), _half(blocks[:, :2]).astype(np.float16), None, 8


def _q4_1(blocks: np.ndarray) -> Decoded:
    return _nibbles(blocks[:, 4:]), _half(blocks[:, :2]).astype(np.float16), _half(blocks[:, 2:4]).astype(np.float16), 0


def _q5_0(blocks: np.ndarray) -> Decoded:
    codes = _nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6]) << 4)
    return codes, _half(blocks[:, :2]).astype(np.float16), None, 16


def _q5_1(blocks: np.ndarray) -> Decoded:
    codes = _nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8]) << 4)
    return codes, _half(blocks[:, :2]).astype(np.float16), _half(blocks[:, 2:4]).astype(np.float16), 0


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-wide sub-block ``(d * sc, -dmin * m)`` ``[n, 8]`` as float16 (Q4_K and Q5_K)."""
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    d, dmin = _half(blocks[:, 0:2])[:, None], _half(blocks[:, 2:4])[:, None]
    return (d * sc).astype(np.float16), (-dmin * m).astype(np.float16)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: each 32 bytes hold sub-block 2i (low nibbles) and 2i + 1 (high nibbles)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)


def _q4_k(blocks: np.ndarray) -> Decoded:
    scales, mins = _k_scales(blocks)
    return _k_low_nibbles(blocks[:, 16:]), scales, mins, 0


def _q5_k(blocks: np.ndarray) -> Decoded:
    scales, mins = _k_scales(blocks)
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit i: sub-block i
    return _k_low_nibbles(blocks[:, 48:]) | ((qh & 1).reshape(-1, 256) << 4), scales, mins, 0


def _q6_k(blocks: np.ndarray) -> Decoded:
    ql, qh = blocks[:, :128].reshape(-1, 2, 1, 64), blocks[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high.reshape(-1, 8, 32) << 4)).astype(np.int32) - 32  # [n, 8 groups, 32]
    sub = blocks[:, 192:208].view(np.int8).astype(np.float32) * _half(blocks[:, 208:210])[:, None]  # [n, 16]
    sub = sub.reshape(-1, 8, 2)
    larger = np.where(np.abs(sub[..., 0]) >= np.abs(sub[..., 1]), sub[..., 0], sub[..., 1])  # [n, 8]
    scale = (larger / 4).astype(np.float16)
    safe = np.where(scale == 0, 1, scale.astype(np.float32))
    values = q.reshape(-1, 8, 2, 16) * sub[..., None]
    codes = np.clip(np.rint(values / safe[..., None, None]), -128, 127).astype(np.int32) + 128
    return codes.astype(np.uint8).reshape(-1, 256), scale, None, 128


_READERS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
            T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}
