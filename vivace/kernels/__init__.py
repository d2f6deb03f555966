"""Native CPU kernels, built on first use with ``torch.utils.cpp_extension`` and cached on disk.

``quant_linear_kernel()`` returns the op ``torch.ops.vivace_kernels.quant_linear`` (schema in
``quant_gemm.cpp``), or None when it cannot be used: the CPU lacks
AVX-512 VNNI, the build fails (no compiler, no ninja), or ``VIVACE_KERNELS=torch`` forces the
pure-PyTorch fallback. Callers must work either way.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from collections.abc import Callable

import torch

_SOURCE = Path(__file__).with_name("quant_gemm.cpp")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
_CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma"]
FORCE_FALLBACK_ENV = "VIVACE_KERNELS"

logger = logging.getLogger(__name__)


def _cpu_supported() -> bool:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return all(flag in flags for flag in _CPU_FLAGS)


def _build_dir(source_hash: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "vivace" / "kernels" / source_hash


@functools.cache
def _load() -> Callable[..., torch.Tensor] | None:
    if not _cpu_supported():
        logger.info("vivace kernels: CPU lacks AVX-512 VNNI; using the PyTorch fallback")
        return None
    source_hash = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    build_dir = _build_dir(source_hash)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils.cpp_extension import load
        load(name=f"vivace_quant_gemm_{source_hash}", sources=[str(_SOURCE)], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
             build_directory=str(build_dir), is_python_module=False, verbose=False)
    except Exception as exc:  # any build or load failure means: use the fallback
        logger.warning("vivace kernels: native build failed (%s); using the PyTorch fallback", exc)
        return None
    torch.library.register_fake("vivace_kernels::quant_linear")(_quant_linear_shape)
    return torch.ops.vivace_kernels.quant_linear.default  # the overload: cheaper to call than the packet


def _quant_linear_shape(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                        bias: torch.Tensor | None, bits: int, out_features: int, group_size: int,
                        zero_point: int) -> torch.Tensor:
    """Output shape and dtype of ``vivace_kernels::quant_linear``, for tracing (torch.compile)."""
    return x.new_empty(*x.shape[:-1], out_features)


def quant_linear_kernel() -> Callable[..., torch.Tensor] | None:
    """The native op, or None when the fallback is forced or the build is unavailable."""
    if os.environ.get(FORCE_FALLBACK_ENV, "").lower() == "torch":
        return None
    return _load()
