"""Random GGUF blocks of any type: random codes, float16 scales set to modest values, so that
formats the ``gguf`` package cannot quantize to (the K-quants) can be tested too."""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
# Byte offsets of each block's float16 fields (scale d, min or dmin), per type.
_HALF_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
                T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,)}
# |w| ~ scale * (largest code magnitude): aim the float16 fields at weights of order 0.1.
_SCALE = {T.Q8_0: 1e-3, T.Q4_0: 1e-2, T.Q5_0: 5e-3, T.Q4_1: 1e-2, T.Q5_1: 5e-3,
          T.Q4_K: 5e-4, T.Q5_K: 2e-4, T.Q6_K: 1e-4, T.Q3_K: 1e-3}


def random_blocks(ggml_type: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Block bytes ``[rows, row_bytes]`` of a ``rows x cols`` weight."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in _HALF_FIELDS[ggml_type]:
        half = (rng.standard_normal((rows, cols // block_size, 1)) * _SCALE[ggml_type]).astype(np.float16)
        raw[:, :, offset:offset + 2] = half.view(np.uint8)
    return raw.reshape(rows, -1)
