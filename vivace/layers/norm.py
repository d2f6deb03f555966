"""RMSNorm as Hugging Face Llama computes it: statistics in float32, weight applied in the model dtype."""

from __future__ import annotations

import torch
from torch import nn

from vivace.layers.fused import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize over the last dimension; the result has ``x``'s dtype. With ``residual``,
        normalize ``residual + x`` and return it too: ``(normed, residual + x)`` (the sum may be
        written into ``residual``)."""
        return rms_norm(x, self.weight, self.eps, residual)
