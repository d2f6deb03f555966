"""FP8 checkpoints in Hugging Face's layouts, read as their tensors stream in: ``compressed-tensors``
(LLM Compressor's FP8 and FP8-dynamic, format ``float-quantized``) and ``fbgemm_fp8``. Both store
a projection's ``weight`` as ``float8_e4m3fn [out, in]`` beside a float ``weight_scale``, one per
tensor (``[]``, ``[1]``) or one per output channel (``[out, 1]``, ``[out]``); the value is
``weight * weight_scale``.

``read_fp8`` pairs each such weight with its scale and either dequantizes it (the CPU backend, and
a GPU that cannot run FP8) or keeps the codes for ``vivace.gpu.fp8_linear``. Activation scales
(a static ``input_scale``, fbgemm's ``input_scale_ub``) are dropped: the GPU quantizes each token's
activations with its own scale as they come, which is at least as fine. KV-cache scales
(``k_scale``, ``v_scale``) pass on to the loader, which leaves them to ``vivace.gpu.kv_fp8``.
Block-wise scales (DeepSeek's ``weight_scale_inv``) are not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

FP8 = torch.float8_e4m3fn
_DROPPED = (".input_scale", ".input_scale_ub")


def read_fp8(tensors: Iterable[tuple[str, torch.Tensor]],
             stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (Hugging Face names) with every FP8 weight replaced: by its float32 value when
    ``stored`` is None, else by a meta tensor of its shape, its ``(codes, float32 scale [out])``
    put in ``stored`` under its name. Other tensors pass unchanged, so a float checkpoint reads as
    before. Raises ValueError for a weight without its scale (or the reverse), another 8-bit float
    type, or scales of another shape."""
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(_DROPPED):
            continue
        if name.endswith(".weight_scale"):
            name = name.removesuffix("_scale")
            scales[name] = tensor
        elif tensor.dtype == FP8:
            codes[name] = tensor
        elif tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:
            raise ValueError(f"{name} is {tensor.dtype}; FP8 checkpoints are read in float8_e4m3fn only")
        else:
            yield name, tensor
            continue
        if name in codes and name in scales:
            yield name, _take(name, codes.pop(name), scales.pop(name), stored)
    if codes or scales:
        raise ValueError(f"FP8 weights and weight_scale tensors do not pair up: {sorted([*codes, *scales])[:8]}")


def channel_scales(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """float32 ``[rows]``: ``scale`` per tensor or per output row, one per row. Raises ValueError
    for any other shape (block-wise scales)."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows).contiguous()
    if scale.numel() == rows and scale.shape[0] == rows:
        return scale.float().reshape(rows)
    raise ValueError(f"{name}_scale has shape {tuple(scale.shape)}; FP8 weights of {rows} rows are read with "
                     "one scale per tensor or per output row")


def _take(name: str, codes: torch.Tensor, scale: torch.Tensor,
          stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
    scale = channel_scales(scale, codes.shape[0], name)
    if stored is None:
        return codes.float() * scale[:, None]
    stored[name] = (codes, scale)
    return torch.empty(codes.shape, device="meta")
