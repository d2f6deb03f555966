"""Weight-only quantized formats: quantizing float weights, reading GGUF blocks, and the tiled
layout the native kernels read.

A quantized weight ``[N, K]`` is ``QuantizedWeight``: unsigned codes (0..255 for 8 bits, 0..63
for 6, 0..31 for 5, 0..15 for 4, 0..7 for 3, 0..3 for 2) and, per row and group of ``group_size`` columns, a scale ``d``
and either a min ``m`` (``w = d * q + m``) or a fixed ``zero_point`` z (``w = d * (q - z)``).
The GGUF K-quants add a second level (``sub_group`` 16 or 32 columns): per sub-group an integer
scale ``sc`` (int8) and, with mins, an integer min ``mi`` (0..63, Q2_K's 0..15), so that the
sub-group's weights are ``w = (d * sc) * q + m * mi`` or ``(d * sc) * (q - z)``, ``d`` and ``m``
then being the super-block's float16 pair (``m = -dmin``): the file's numbers, nothing rounded.
A 4-bit weight with a zero point may carry a ``codebook`` (GGUF IQ4_NL/IQ4_XS): 16 unsigned bytes
that its codes index, ``w = d * (codebook[q] - z)``. The kernel looks each nibble up (a byte
shuffle) and takes the dot products of the bytes it finds, so the weight streams at 4 bits.
The tiled layout groups 16 output rows: codes ``[N/16, K/4, 16, 4]`` bytes for 8 bits, or
``[N/16, K/8, 16, 4]`` bytes for 4 bits (low nibble k in 8j..8j+3, high nibble 8j+4..8j+7);
5 bits are ``[N/16, K/32, 5, 64]``: per 32 columns the 4-bit layout of the low four bits, then
64 bytes whose byte ``4r + i`` holds in bit ``2j + h`` the fifth bit of row r's column
``8j + 4h + i``; 6 bits are ``[N/16, K/32, 6, 64]``: the 4-bit layout of the low four bits, then
two vectors of the top two bits, vector v's byte ``4r + i`` holding in bits ``2f, 2f + 1``
(``f = 2j' + h``) those of row r's column ``8(2v + j') + 4h + i`` (vector v: columns 16v..16v+15,
one Q6_K sub-block); 2 bits are ``[N/16, K/32, 2, 64]``: the 4-bit layout's nibble vectors 2v and
2v + 1 folded into vector v, its byte ``4r + i`` holding in bits ``2f, 2f + 1`` row r's column
``16v + 4f + i`` (columns 16v..16v+15, one Q2_K sub-block); 3 bits are ``[N/16, K/32, 3, 64]``:
the 2-bit layout of the low two bits, then the 5-bit layout's plane of the third bits.
Scales and mins ``[N/16, K/group_size, 16]`` float16, sub-group scales and
mins ``[N/16, K/sub_group, 16]`` int8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    sub_scales: torch.Tensor | None = None  # [N, K / sub_group] int8, or None: no second level
    sub_mins: torch.Tensor | None = None  # like sub_scales (0..63) when mins is set
    sub_group: int = 0
    codebook: torch.Tensor | None = None  # [16] uint8 that the 4-bit codes index, or None: the codes themselves

    def __post_init__(self) -> None:
        if self.codebook is not None and (self.bits != 4 or self.mins is not None or self.sub_scales is not None
                                          or self.codebook.shape != (16,) or self.codebook.dtype != torch.uint8):
            raise ValueError("a codebook is 16 uint8 entries for 4-bit codes with a zero point and one level of scales")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[N, K]`` these codes stand for (float32 products in the order
        ``gguf.quants`` computes them, so K-quants match its dequantization bit for bit)."""
        n, k = self.codes.shape
        scales, mins, group = self._group_scales()
        codes = self.looked_up_codes().view(n, k // group, group).to(torch.float32)
        if mins is None:
            weight = (codes - self.zero_point) * scales.unsqueeze(-1)
        else:
            weight = codes * scales.unsqueeze(-1) + mins.unsqueeze(-1)
        return weight.view(n, k).to(dtype)

    def looked_up_codes(self) -> torch.Tensor:
        """The codes ``[N, K]`` uint8 that the scales apply to: the codebook's entries where there
        is one, else the codes themselves."""
        return self.codes if self.codebook is None else self.codebook[self.codes.long()]

    def _group_scales(self) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """float32 scales and mins per group of the finest level, and that group's width."""
        scales = self.scales.to(torch.float32)
        mins = None if self.mins is None else self.mins.to(torch.float32)
        if self.sub_scales is None:
            return scales, mins, self.group_size
        per = self.group_size // self.sub_group
        scales = scales.repeat_interleave(per, dim=1) * self.sub_scales.to(torch.float32)
        if mins is not None:
            mins = mins.repeat_interleave(per, dim=1) * self.sub_mins.to(torch.float32)
        return scales, mins, self.sub_group

    def grouped(self) -> QuantizedWeight:
        """One level of float16 scales (and mins) per group of 32, codes as they are: the
        sub-group products ``d * sc`` and ``m * mi`` rounded to float16 (a relative error of at
        most 2^-11 on each). Only for sub-groups of 32 (Q4_K, Q5_K)."""
        if self.sub_scales is None:
            return self
        if self.sub_group != 32:
            raise ValueError(f"sub-groups of {self.sub_group} columns have no one-level form with 32-column groups")
        scales, mins, group = self._group_scales()
        return replace(self, scales=scales.to(torch.float16), mins=None if mins is None else mins.to(torch.float16),
                       group_size=group, sub_scales=None, sub_mins=None, sub_group=0)

    def widened(self) -> QuantizedWeight:
        """The same weight as 8-bit codes with per-group-of-32 mins (``m = -z * d`` for a zero
        point, exact in float16 for the power-of-two zero points used here): a form every weight
        of one group size shares (benchmarks/kernels.py sets it against the native ones). Two-level
        weights lose a little: Q4_K/Q5_K as ``grouped``; Q6_K's 16-wide sub-groups are requantized
        to groups of 32 with scale ``s / 4`` of the pair's larger sub-group scale ``s``, so that
        sub-group maps exactly (``4 * (q - 32)``) and the other is rounded to the nearest
        multiple: an error of at most ``s / 8`` per weight (Q3_K likewise). Raises ValueError for
        16-wide sub-groups with mins (Q2_K), which have no such form."""
        if self.sub_scales is not None and self.sub_group != 32:
            if self.mins is not None:
                raise ValueError("16-column sub-groups with mins (Q2_K) have no widened form")
            return self._requantized_to_groups_of_32()
        weight = self.grouped()
        mins = weight.mins
        if mins is None:
            mins = (weight.scales.float() * -weight.zero_point).to(torch.float16)
        return QuantizedWeight(weight.looked_up_codes(), weight.scales, mins, 0, 8, weight.group_size)

    def _requantized_to_groups_of_32(self) -> QuantizedWeight:
        n, k = self.codes.shape
        scales, _, group = self._group_scales()  # [n, K / 16], zero point form (Q6_K, Q3_K)
        pairs = scales.view(n, -1, 32 // group)
        larger = torch.where(pairs[..., 0].abs() >= pairs[..., 1].abs(), pairs[..., 0], pairs[..., 1])
        scale = (larger / 4).to(torch.float16)
        safe = torch.where(scale == 0, 1.0, scale.to(torch.float32))
        values = (self.codes.to(torch.float32) - self.zero_point).view(n, -1, 32 // group, group) * pairs[..., None]
        codes = torch.round(values / safe[..., None, None]).clamp(-128, 127) + 128
        widened = QuantizedWeight(codes.to(torch.uint8).view(n, k), scale, None, 128, 8, 32)
        return widened.widened()


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
_TOP_BITS_SHIFTS = (2 * torch.arange(4, dtype=torch.int32)).view(2, 2)  # [j', h]: bits 2f, f = 2j' + h
_TOP_BITS_PLACES = 1 << _TOP_BITS_SHIFTS


def tile_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Row-major codes ``[N, K]`` to the kernels' tiled bytes (module docstring)."""
    n, k = codes.shape
    if bits in (2, 3):
        # The 4-bit layout of the low two bits, [.., v, j'] for nibble vector 2v + j'; each byte's
        # nibbles (h = 0, 1) to bits 2h, 2h + 1, then j' = 1 above j' = 0: bits 2f, f = 2j' + h.
        pairs = tile_codes(codes & 3, 4).view(n // TILE_ROWS, k // 32, 2, 2, 64)
        crumbs = (pairs & 3) | ((pairs >> 4) << 2)
        crumbs = crumbs[:, :, :, 0] | (crumbs[:, :, :, 1] << 4)
        return crumbs if bits == 2 else torch.cat([crumbs, _bit_plane(codes >> 2)], dim=2).contiguous()
    if bits == 6:
        groups = k // 32
        low = tile_codes(codes & 0x0F, 4).view(n // TILE_ROWS, groups, 4, 64)
        top = (codes >> 4).view(n // TILE_ROWS, TILE_ROWS, groups, 2, 2, 2, 4).permute(0, 2, 3, 1, 6, 4, 5)
        packed = (top.to(torch.int32) * _TOP_BITS_PLACES).sum(dim=(-2, -1)).to(torch.uint8)
        return torch.cat([low, packed.reshape(n // TILE_ROWS, groups, 2, 64)], dim=2).contiguous()
    if bits == 5:
        low = tile_codes(codes & 0x0F, 4).view(n // TILE_ROWS, k // 32, 4, 64)
        return torch.cat([low, _bit_plane(codes >> 4)], dim=2).contiguous()
    if bits == 8:
        return codes.view(n // TILE_ROWS, TILE_ROWS, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    quads = codes.view(n // TILE_ROWS, TILE_ROWS, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
    return (quads[:, :, 0] | (quads[:, :, 1] << 4)).contiguous()


def _bit_plane(bits: torch.Tensor) -> torch.Tensor:
    """One bit a code ``[N, K]`` (0 or 1) as the 5-bit layout's planes ``[N/16, K/32, 1, 64]``:
    byte ``4r + i`` holds in bit ``2j + h`` row r's column ``8j + 4h + i``."""
    n, k = bits.shape
    bits = bits.view(n // TILE_ROWS, TILE_ROWS, k // 32, 4, 2, 4).permute(0, 2, 1, 5, 3, 4)
    packed = (bits.to(torch.int32) * _FIFTH_BIT_PLACES).sum(dim=(-2, -1)).to(torch.uint8)
    return packed.view(n // TILE_ROWS, k // 32, 1, 64)


def _plane_bits(plane: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_bit_plane``: ``[tiles, K/32, 64]`` planes to bits ``[N, K]`` (uint8)."""
    tiles, groups = plane.shape[:2]
    bits = (plane.reshape(tiles, groups, TILE_ROWS, 4, 1, 1).to(torch.int32) & _FIFTH_BIT_PLACES) != 0
    return bits.permute(0, 2, 1, 4, 5, 3).reshape(tiles * TILE_ROWS, groups * 32).to(torch.uint8)


def untile_codes(tiled: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``tile_codes``: row-major codes ``[N, K]``."""
    tiles, kq = tiled.shape[:2]
    if bits in (2, 3):
        crumbs = tiled[:, :, :2].unsqueeze(3)  # [tiles, groups, v, 1, 64]
        pairs = torch.cat([crumbs & 0x0F, crumbs >> 4], dim=3)  # nibble vector 2v + j', bits 2h: column 4h + i
        nibbles = (pairs & 3) | ((pairs >> 2) << 4)
        low = untile_codes(nibbles.reshape(tiles, kq * 4, TILE_ROWS, 4), 4)
        return low if bits == 2 else low | (_plane_bits(tiled[:, :, 2]) << 2)
    if bits == 6:
        low = untile_codes(tiled[:, :, :4].reshape(tiles, kq * 4, TILE_ROWS, 4), 4)
        packed = tiled[:, :, 4:].reshape(tiles, kq, 2, TILE_ROWS, 4, 1, 1).to(torch.int32)
        top = (packed >> _TOP_BITS_SHIFTS) & 3  # [tiles, groups, v, r, i, j', h]
        top = top.permute(0, 3, 1, 2, 5, 6, 4).reshape(tiles * TILE_ROWS, kq * 32)
        return low | (top.to(torch.uint8) << 4)
    if bits == 5:
        low = untile_codes(tiled[:, :, :4].reshape(tiles, kq * 4, TILE_ROWS, 4), 4)
        return low | (_plane_bits(tiled[:, :, 4]) << 4)
    if bits == 8:
        return tiled.permute(0, 2, 1, 3).reshape(tiles * TILE_ROWS, kq * 4)
    quads = torch.stack([tiled & 0x0F, tiled >> 4], dim=2)  # [tiles, K/8, 2, 16, 4]
    return quads.permute(0, 3, 1, 2, 4).reshape(tiles * TILE_ROWS, kq * 8)


def tile_groups(values: torch.Tensor) -> torch.Tensor:
    """Per-group values ``[N, G]`` to ``[N/16, G, 16]``, of the same dtype."""
    n, groups = values.shape
    return values.view(n // TILE_ROWS, TILE_ROWS, groups).transpose(1, 2).contiguous()


def untile_groups(tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of ``tile_groups``: ``[N, G]``."""
    tiles, groups, _ = tiled.shape
    return tiled.transpose(1, 2).reshape(tiles * TILE_ROWS, groups)
