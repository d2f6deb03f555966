"""Weight-only quantized linear layers (int8 per output row, int4 per group, GGUF formats).

``QuantizedLinear`` keeps its weight in the tiled layout of ``vivace.layers.quant_format`` and
runs the native kernel, AVX-512 VNNI or AVX2 (activations quantized to int8 per group of 32 on the fly)
when it is available, else a pure-PyTorch fallback that dequantizes and calls ``F.linear``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vivace.kernels import quant_linear_kernel
from vivace.layers import quant_format as qf
from vivace.layers.gguf_blocks import from_gguf_blocks

QuantMode = Literal["int8", "int4"]
Backend = Literal["native", "torch"]
ACTIVATION_GROUP = 32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class QuantizedLinear(nn.Module):
    """``y = x @ W^T + b`` for a quantized ``W [out_features, in_features]``.

    ``x [..., in_features]`` of any float dtype; ``y`` has its dtype. ``backend`` is "native"
    when the kernel loaded, else "torch"; assign "torch" to force the fallback for this layer
    (``VIVACE_KERNELS=torch`` forces it everywhere).
    """

    def __init__(self, weight: qf.QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        n, k = weight.codes.shape
        if k % ACTIVATION_GROUP or k % weight.group_size or weight.group_size % ACTIVATION_GROUP:
            raise ValueError(f"in_features {k} and group_size {weight.group_size} must be multiples of "
                             f"{ACTIVATION_GROUP}, with the group size dividing in_features")
        self.in_features, self.out_features = k, n
        self.bits, self.group_size, self.zero_point = weight.bits, weight.group_size, weight.zero_point
        self.sub_group = weight.sub_group
        weight = _pad_rows(weight)
        self.register_buffer("codes", qf.tile_codes(weight.codes, weight.bits))
        # float16 scales and mins are kept as int16 bit patterns so that ``module.to(dtype)`` keeps them.
        self.register_buffer("scales", qf.tile_groups(weight.scales.to(torch.float16)).view(torch.int16))
        mins = None if weight.mins is None else qf.tile_groups(weight.mins.to(torch.float16)).view(torch.int16)
        self.register_buffer("mins", mins)
        # K-quants' sub-block scales and mins: int8, which ``module.to(dtype)`` leaves alone.
        self.register_buffer("sub_scales", None if weight.sub_scales is None else qf.tile_groups(weight.sub_scales))
        self.register_buffer("sub_mins", None if weight.sub_mins is None else qf.tile_groups(weight.sub_mins))
        # IQ4's 16-entry table (uint8, left alone by ``module.to(dtype)`` too): an argument of the op
        # rather than a constant of the kernel, so that the kernel stays one loop for any table.
        self.register_buffer("codebook", weight.codebook)
        padded_bias = None
        if bias is not None:
            padded_bias = torch.zeros(weight.codes.shape[0], dtype=torch.float32)
            padded_bias[:n] = bias.detach().to(torch.float32)
        self.register_buffer("bias", padded_bias)
        self.backend = "native"

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, mode: QuantMode = "int8",
                   group_size: int = 32) -> QuantizedLinear:
        """Quantize a float weight: int8 symmetric per output row, or int4 asymmetric per group."""
        if mode == "int8":
            return cls(qf.quantize_int8(weight), bias)
        if mode == "int4":
            return cls(qf.quantize_int4(weight, group_size), bias)
        raise ValueError(f"quantization mode must be 'int8' or 'int4', got {mode!r}")

    @classmethod
    def from_gguf(cls, data: np.ndarray, ggml_type: gguf.GGMLQuantizationType,
                  bias: torch.Tensor | None = None) -> QuantizedLinear:
        """Build from GGUF block bytes ``[out_features, row_bytes]`` of a type in
        ``vivace.layers.gguf_blocks.NATIVE_TYPES``."""
        return cls(from_gguf_blocks(data, ggml_type), bias)

    @property
    def backend(self) -> Backend:
        return "torch" if self._kernel is None else "native"

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self._kernel = quant_linear_kernel() if backend == "native" else None

    def quantized_rows(self, rows: torch.Tensor | None = None) -> qf.QuantizedWeight:
        """The row-major quantized weight, of all rows or of the output rows ``rows``."""
        if rows is None:
            rows = torch.arange(self.out_features)
            codes = qf.untile_codes(self.codes, self.bits)[: self.out_features]
        else:  # the tile of each row, untiled, then the row's lane in it
            codes = qf.untile_codes(self.codes[rows // qf.TILE_ROWS], self.bits).view(len(rows), qf.TILE_ROWS, -1)
            codes = codes[torch.arange(len(rows)), rows % qf.TILE_ROWS]
        tile, lane = rows // qf.TILE_ROWS, rows % qf.TILE_ROWS
        mins = None if self.mins is None else self.mins[tile, :, lane].view(torch.float16)
        scales = self.scales[tile, :, lane].view(torch.float16)
        sub_scales, sub_mins = (None if t is None else t[tile, :, lane] for t in (self.sub_scales, self.sub_mins))
        return qf.QuantizedWeight(codes, scales, mins, self.zero_point, self.bits, self.group_size,
                                  sub_scales, sub_mins, self.sub_group, self.codebook)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out_features, in_features]`` this layer multiplies by."""
        return self.quantized_rows().dequantize(dtype)

    def weight_bytes(self) -> int:
        """Bytes of codes, scales and mins (and codebook) one forward pass reads."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins, self.sub_scales,
                                                          self.sub_mins, self.codebook) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and x.dtype in _KERNEL_DTYPES:
            return self._kernel(x, self.codes, self.scales, self.mins, self.bias, self.bits, self.out_features,
                                self.group_size, self.zero_point, self.sub_scales, self.sub_mins, self.sub_group,
                                self.codebook)
        bias = None if self.bias is None else self.bias[: self.out_features].to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        sub = f", sub_group={self.sub_group}" if self.sub_group else ""
        sub += ", codebook" if self.codebook is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}{sub}, bias={self.bias is not None}, backend={self.backend}")


class StackedLinear(nn.Module):
    """One projection whose output rows come in runs of different formats (a fused q/k/v whose v
    a GGUF file stores in more bits): each run through its own layer (``QuantizedLinear`` on CPU,
    ``vivace.gpu.gguf_linear.GgufLinear`` on a GPU), the outputs concatenated."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        if len({part.in_features for part in parts}) != 1:
            raise ValueError("stacked parts must share in_features")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([part.dequantize(dtype) for part in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _pad_rows(weight: qf.QuantizedWeight) -> qf.QuantizedWeight:
    """Pad the output rows to a multiple of 16 with zero-scale rows (their outputs are dropped)."""
    n = weight.codes.shape[0]
    pad = -n % qf.TILE_ROWS
    if pad == 0:
        return weight
    def padded(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else F.pad(t, (0, 0, 0, pad))

    return replace(weight, codes=padded(weight.codes), scales=padded(weight.scales), mins=padded(weight.mins),
                   sub_scales=padded(weight.sub_scales), sub_mins=padded(weight.sub_mins))
