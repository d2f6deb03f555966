"""Rotary position embedding, neox style (rotate halves), as Hugging Face Llama applies it.

cos/sin are precomputed once for every position up to the context length; a forward pass
only indexes them, so the decode step does no trigonometry.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Float32 ``[head_dim // 2]`` rotation speeds, computed as transformers computes them.

    ``scaling`` is None (plain RoPE) or has ``rope_type`` "default", "linear" (``factor``),
    "llama3" (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``) or "freq_factors" (``freq_factors``: llama.cpp's
    per-frequency divisors). Raises ValueError for any other type.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float)
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


class RotaryEmbedding(nn.Module):
    """Holds cos and sin ``[max_positions, head_dim // 2]`` in the model's dtype."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__()
        # Computed, never loaded: made real even when the model is built on the meta device.
        with torch.device("cpu"):
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float),
                                inverse_frequencies(head_dim, theta, scaling))
            self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
            self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[num_tokens, 1, head_dim // 2]`` for ``positions`` ``[num_tokens]``,
        shaped to broadcast over heads in ``apply_rotary``."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]``: pairs are (i, i + head_dim/2), as in HF's rotate_half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
