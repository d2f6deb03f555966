"""Fused elementwise steps of the Llama forward: SiLU-and-multiply (GELU-and-multiply for
Gemma), RMSNorm (with the residual add folded in) and the rotary rotation, each one native pass
(``fused.cpp``) in eager mode.

Every function here computes what its PyTorch formulation computes, and uses that formulation
when the native library did not build, or for dtypes or devices the kernels don't take. The
native ops are also what a compiled decode graph calls (they have fake kernels for tracing), so
that compiled and eager steps give bit-identical values: inductor's own fusion of the PyTorch
formulation rounds differently in the last bit, and with activations quantized to int8 such a
bit can move a code, grow through the layers (~0.5 in the default model's logits) and change a
greedy token depending on whether a row ran compiled or eager, i.e. on the batch it was in.
Calling them from the graph costs nothing measurable (default model, batch 1 and 4).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vivace.layers import rotary
from vivace.layers import native

NATIVE = native.load("fused")
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native(x: torch.Tensor) -> bool:
    return NATIVE and x.device.type == "cpu" and x.dtype in _NATIVE_DTYPES


def _gated_mul(x: torch.Tensor, op: str, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``activation(gate) * up`` for ``x = [gate | up]`` ``[num_tokens, 2 * width]``: the native
    ``torch.ops.vivace.<op>`` where it serves ``x``."""
    if _native(x) and x.dim() == 2 and x.stride(-1) == 1:
        return getattr(torch.ops.vivace, op)(x)
    gate, up = x.chunk(2, dim=-1)
    return activation(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` ``[num_tokens, 2 * width]``."""
    return _gated_mul(x, "silu_mul", F.silu)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (Gemma's MLP) for ``x = [gate | up]``."""
    return _gated_mul(x, "gelu_tanh_mul", functools.partial(F.gelu, approximate="tanh"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` ``[num_tokens, hidden]`` as Hugging Face Llama computes it (statistics in
    float32, the normalized value rounded to ``x``'s dtype, then times ``weight``).

    With ``residual``: normalize ``residual + x`` instead and return ``(normed, residual + x)``;
    the sum may be written into ``residual`` in place.
    """
    if _native(x) and x.dim() == 2 and weight.dtype == x.dtype:
        if residual is None:
            return torch.ops.vivace.rms_norm(x, weight, eps)
        return torch.ops.vivace.add_rms_norm(x, residual, weight, eps), residual
    if residual is not None:
        residual = residual + x
        return _torch_rms_norm(residual, weight, eps), residual
    return _torch_rms_norm(x, weight, eps)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by each token's ``cos``/``sin``
    ``[num_tokens, 1, head_dim // 2]``: pairs are (i, i + head_dim/2), as in HF's rotate_half.
    May rotate ``x`` in place; use the returned tensor."""
    if _native(x) and x.stride(-1) == 1 and cos.dtype == x.dtype:
        torch.ops.vivace.rotary_(x, cos, sin)
        return x
    return rotary.apply_rotary(x, cos, sin)


if NATIVE:
    def _half_width(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    for _op in ("silu_mul", "gelu_tanh_mul"):
        torch.library.register_fake(f"vivace::{_op}")(_half_width)

    @torch.library.register_fake("vivace::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("vivace::add_rms_norm")
    def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("vivace::rotary_")
    def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        return None
