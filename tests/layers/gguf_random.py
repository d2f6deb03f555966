"""Random GGUF blocks of any type: random codes, float16 scales set to modest values, so that
formats the ``gguf`` package cannot quantize to (the K-quants) can be tested too. numpy's draw of
``vivace.models.dummy.random_gguf_blocks`` (which draws on a device, for benchmarks)."""

from __future__ import annotations

import gguf
import numpy as np

from vivace.models.dummy import GGUF_FIELD_STD, GGUF_HALF_FIELDS



def random_blocks(ggml_type: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Block bytes ``[rows, row_bytes]`` of a ``rows x cols`` weight."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in GGUF_HALF_FIELDS[ggml_type]:
        half = (rng.standard_normal((rows, cols // block_size, 1)) * GGUF_FIELD_STD[ggml_type]).astype(np.float16)
        raw[:, :, offset:offset + 2] = half.view(np.uint8)
    return raw.reshape(rows, -1)
