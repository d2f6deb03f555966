"""Weight-only quantized formats: quantizing float weights, reading GGUF blocks, and the tiled
layout the native kernels read.

A quantized weight ``[N, K]`` is ``QuantizedWeight``: unsigned codes (0..255 for 8 bits, 0..31
for 5, 0..15 for 4) and, per row and group of ``group_size`` columns, a scale ``d`` and either a
min ``m`` (``w = d * q + m``) or a fixed ``zero_point`` z (``w = d * (q - z)``).
The tiled layout groups 16 output rows: codes ``[N/16, K/4, 16, 4]`` bytes for 8 bits, or
``[N/16, K/8, 16, 4]`` bytes for 4 bits (low nibble k in 8j..8j+3, high nibble 8j+4..8j+7);
5 bits are ``[N/16, K/32, 5, 64]``: per 32 columns the 4-bit layout of the low four bits, then
64 bytes whose byte ``4r + i`` holds in bit ``2j + h`` the fifth bit of row r's column
``8j + 4h + i``. Scales and mins ``[N/16, K/group_size, 16]`` float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE_ROWS = 16


@dataclass(frozen=True)
class QuantizedWeight:
    """Row-major (untiled) quantized weight; see the module docstring for the encoding."""

    codes: torch.Tensor  # [N, K] uint8
    scales: torch.Tensor  # [N, K / group_size] float16
    mins: torch.Tensor | None  # like scales, or None when zero_point applies
    zero_point: int
    bits: int
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[N, K]`` these codes stand for."""
        n, k = self.codes.shape
        codes = self.codes.view(n, k // self.group_size, self.group_size).to(torch.float32)
        scales = self.scales.to(torch.float32).unsqueeze(-1)
        if self.mins is None:
            weight = (codes - self.zero_point) * scales
        else:
            weight = codes * scales + self.mins.to(torch.float32).unsqueeze(-1)
        return weight.view(n, k).to(dtype)

    def widened(self) -> QuantizedWeight:
        """The same weight as 8-bit codes with per-group mins (``m = -z * d`` for a zero point,
        exact in float16 for the power-of-two zero points used here): a form every weight of
        one group size shares, so weights of different formats can be stacked."""
        mins = self.mins if self.mins is not None else (self.scales.float() * -self.zero_point).to(torch.float16)
        return QuantizedWeight(self.codes, self.scales, mins, 0, 8, self.group_size)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row (codes offset by 128)."""
    w = weight.detach().to(torch.float32)
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16)
    safe = torch.where(scales == 0, 1.0, scales.to(torch.float32))
    codes = (torch.round(w / safe).clamp(-127, 127) + 128).to(torch.uint8)
    return QuantizedWeight(codes, scales, None, 128, 8, w.shape[1])


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4 per group of ``group_size`` columns (scale and min, like GGUF Q4_1)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    w = weight.detach().to(torch.float32).view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15).to(torch.float16)
    mins = lo.to(torch.float16)
    safe = torch.where(scales == 0, 1.0, scales.to(torch.float32)).unsqueeze(-1)
    codes = torch.round((w - mins.to(torch.float32).unsqueeze(-1)) / safe).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(codes.view(n, k), scales, mins, 0, 4, group_size)


_FIFTH_BIT_PLACES = (1 << torch.arange(8, dtype=torch.int32)).view(4, 2)  # [j, h]: bit 2j + h


def tile_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Row-major codes ``[N, K]`` to the kernels' tiled bytes (module docstring)."""
    n, k = codes.shape
    if bits == 5:
        groups = k // 32
        low = tile_codes(codes & 0x0F, 4).view(n // TILE_ROWS, groups, 4, 64)
        fifth = (codes >> 4).view(n // TILE_ROWS, TILE_ROWS, groups, 4, 2, 4).permute(0, 2, 1, 5, 3, 4)
        packed = (fifth.to(torch.int32) * _FIFTH_BIT_PLACES).sum(dim=(-2, -1)).to(torch.uint8)
        return torch.cat([low, packed.view(n // TILE_ROWS, groups, 1, 64)], dim=2).contiguous()
    if bits == 8:
        return codes.view(n // TILE_ROWS, TILE_ROWS, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    quads = codes.view(n // TILE_ROWS, TILE_ROWS, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
    return (quads[:, :, 0] | (quads[:, :, 1] << 4)).contiguous()


def untile_codes(tiled: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``tile_codes``: row-major codes ``[N, K]``."""
    tiles, kq = tiled.shape[:2]
    if bits == 5:
        low = untile_codes(tiled[:, :, :4].reshape(tiles, kq * 4, TILE_ROWS, 4), 4)
        packed = tiled[:, :, 4].reshape(tiles, kq, TILE_ROWS, 4, 1, 1).to(torch.int32)
        fifth = (packed & _FIFTH_BIT_PLACES) != 0  # [tiles, groups, r, i, j, h]
        fifth = fifth.permute(0, 2, 1, 4, 5, 3).reshape(tiles * TILE_ROWS, kq * 32)
        return low | (fifth.to(torch.uint8) << 4)
    if bits == 8:
        return tiled.permute(0, 2, 1, 3).reshape(tiles * TILE_ROWS, kq * 4)
    quads = torch.stack([tiled & 0x0F, tiled >> 4], dim=2)  # [tiles, K/8, 2, 16, 4]
    return quads.permute(0, 3, 1, 2, 4).reshape(tiles * TILE_ROWS, kq * 8)


def tile_groups(values: torch.Tensor) -> torch.Tensor:
    """Per-group values ``[N, G]`` to ``[N/16, G, 16]`` float16."""
    n, groups = values.shape
    return values.to(torch.float16).view(n // TILE_ROWS, TILE_ROWS, groups).transpose(1, 2).contiguous()


def untile_groups(tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of ``tile_groups``: ``[N, G]``."""
    tiles, groups, _ = tiled.shape
    return tiled.transpose(1, 2).reshape(tiles * TILE_ROWS, groups)
