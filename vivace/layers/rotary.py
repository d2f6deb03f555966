"""Rotary position embedding, neox style (rotate halves), as Hugging Face Llama applies it.

cos/sin are precomputed once for every position up to the context length; a forward pass
only indexes them, so the decode step does no trigonometry.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None,
                        context_length: int | None = None) -> torch.Tensor:
    """Float32 ``[rotary_dim // 2]`` rotation speeds, computed as transformers computes them.

    ``scaling`` is None (plain RoPE) or has ``rope_type`` "default", "linear" (``factor``),
    "llama3" (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``), "freq_factors" (``freq_factors``: llama.cpp's
    per-frequency divisors), "longrope" (``short_factor``, ``long_factor``,
    ``original_max_position_embeddings``) or "yarn" (``factor``, ``original_max_position_embeddings``,
    ``beta_fast``, ``beta_slow``, ``truncate``). LongRoPE divides by its long factors when
    ``context_length`` (the positions the model serves) exceeds the original context, by its short
    ones otherwise: chosen once, as llama.cpp does, where transformers chooses per forward from the
    batch's longest sequence (which would make logits depend on batch composition). Raises
    ValueError for any other type.
    """
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    inv_freq = 1.0 / pos_freqs
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float)
    if rope_type == "longrope":
        long = (context_length or 0) > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float)
        return 1.0 / (factors * pos_freqs)
    if rope_type == "yarn":
        return _yarn(pos_freqs, theta, scaling)
    raise ValueError(f"unsupported rope scaling {rope_type!r}")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: slow frequencies divided by ``factor``, fast ones kept, a smooth blend between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context_len / low, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context_len / high) * ~(wavelen > old_context_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(pos_freqs: torch.Tensor, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies that turn more than ``beta_fast`` times over the original context are kept,
    those that turn fewer than ``beta_slow`` times divided by ``factor``, a linear ramp between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    dim = 2 * len(pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def longrope_attention_factor(factor: float, original_context: int) -> float:
    """LongRoPE's default scale of cos and sin for a context ``factor`` times the original."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_context))


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's default scale of cos and sin (DeepSeek's ratio of two when ``mscale`` and
    ``mscale_all_dim`` are both set), as transformers' ``get_mscale``."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def rotary_tables(head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                  rotary_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 cos and sin ``[max_positions, head_dim // 2]``. The first ``rotary_dim // 2`` columns
    (all when None) rotate, times ``scaling``'s ``attention_factor`` (1 when absent), as
    transformers scales cos and sin; the rest hold cos 1, sin 0, which leaves those pairs of
    dimensions as they are (partial rotary, its pass-through dimensions laid out there by
    ``vivace.models.partial_rotary``; with ``rotary_dim`` 0, every pair: a NoPE layer's table)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float),
                        inverse_frequencies(rotary_dim, theta, scaling, max_positions))
    attention_factor = (scaling or {}).get("attention_factor", 1.0)
    cos = torch.ones(max_positions, head_dim // 2)
    sin = torch.zeros(max_positions, head_dim // 2)
    cos[:, :rotary_dim // 2] = freqs.cos() * attention_factor
    sin[:, :rotary_dim // 2] = freqs.sin() * attention_factor
    return cos, sin


class RotaryEmbedding(nn.Module):
    """Holds cos and sin ``[max_positions, head_dim // 2]`` in the model's dtype (``rotary_tables``)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype, rotary_dim: int | None = None) -> None:
        super().__init__()
        # Computed, never loaded: made real even when the model is built on the meta device.
        with torch.device("cpu"):
            cos, sin = rotary_tables(head_dim, max_positions, theta, scaling, rotary_dim)
            self.register_buffer("cos", cos.to(dtype), persistent=False)
            self.register_buffer("sin", sin.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[num_tokens, 1, head_dim // 2]`` for ``positions`` ``[num_tokens]``,
        shaped to broadcast over heads in ``apply_rotary``."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def query_temperature(positions: torch.Tensor, beta: float, period: int) -> torch.Tensor:
    """Float32 ``[num_tokens]`` factors of Llama 4's attention temperature (Ministral 3), as
    transformers computes them: ``1 + beta * log(1 + floor(p / period))`` for each position ``p``;
    exactly 1 below ``period``."""
    return 1 + beta * torch.log(1 + torch.floor(positions / period))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]``: pairs are (i, i + head_dim/2), as in HF's rotate_half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
