"""Native CPU kernels for weight-only quantized linear layers (built by ``vivace.layers.native``).

``quant_linear_kernel()`` returns the op ``torch.ops.vivace_kernels.quant_linear`` (schema in
``quant_gemm.cpp``), or None when it cannot be used: the CPU has neither AVX-512 VNNI nor the
AVX2 of the SIMDe build (``vivace.layers.native``), the build fails (no compiler, no ninja), or
``VIVACE_KERNELS=torch`` forces the pure-PyTorch fallback.
Callers must work either way.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from vivace.layers import native
from vivace.layers.native import FORCE_FALLBACK_ENV



@functools.cache
def _load() -> Callable[..., torch.Tensor] | None:
    if not native.load("quant_gemm"):
        return None
    torch.library.register_fake("vivace_kernels::quant_linear")(_quant_linear_shape)
    return torch.ops.vivace_kernels.quant_linear.default  # the overload: cheaper to call than the packet


def _quant_linear_shape(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                        bias: torch.Tensor | None, bits: int, out_features: int, group_size: int,
                        zero_point: int, sub_scales: torch.Tensor | None = None, sub_mins: torch.Tensor | None = None,
                        sub_group: int = 0, codebook: torch.Tensor | None = None) -> torch.Tensor:
    """Output shape and dtype of ``vivace_kernels::quant_linear``, for tracing (torch.compile)."""
    return x.new_empty(*x.shape[:-1], out_features)


def quant_linear_kernel() -> Callable[..., torch.Tensor] | None:
    """The native op, or None when the fallback is forced or the build is unavailable."""
    if os.environ.get(FORCE_FALLBACK_ENV, "").lower() == "torch":
        return None
    return _load()
