"""Building and loading vivace's native op libraries (C++ files registering ``torch.ops.vivace``).

Each library (a C++ file, plus the headers beside it) is compiled once with ``torch.utils.cpp_extension`` into
``~/.cache/vivace/kernels/<name>-<hash of source, flags and torch version>`` and loaded from
there by later processes. Callers fall back to PyTorch code when ``load_library`` says False.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

FORCE_FALLBACK_ENV = "VIVACE_KERNELS"  # "torch": use no native library
# -fopenmp: at::parallel_for is an OpenMP pragma in a header; without it an op runs on one thread.
AVX512_CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mf16c", "-mfma", "-fopenmp")
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c", "fma")

logger = logging.getLogger(__name__)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it can't be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_has(flags: tuple[str, ...]) -> bool:
    """Whether the CPU has every one of ``flags`` (False where /proc/cpuinfo can't be read)."""
    return cpu_flags().issuperset(flags)


def load_library(source: Path, cflags: tuple[str, ...] = (), cpu_flags: tuple[str, ...] = ()) -> bool:
    """Build ``source`` (or reuse its cached build) and load it into this process, which runs its
    op registrations. False, and nothing loaded, when ``VIVACE_KERNELS=torch``, the CPU lacks one
    of ``cpu_flags``, or the build or load fails (logged)."""
    if os.environ.get(FORCE_FALLBACK_ENV, "").lower() == "torch" or not cpu_has(cpu_flags):
        return False
    # The headers beside the source are part of what is built.
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = source.read_bytes() + headers + " ".join(cflags).encode() + torch.__version__.encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    build_dir = cache / "vivace" / "kernels" / f"{source.stem}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not any(build_dir.glob("*.so")):
        logger.info("vivace: building native %s (once per source and machine; tens of seconds)...", source.name)
    try:
        from torch.utils.cpp_extension import load
        with _building(build_dir):
            load(name=f"vivace_{source.stem}_{digest}", sources=[str(source)], extra_cflags=list(cflags),
                 build_directory=str(build_dir), is_python_module=False, verbose=False)
    except Exception as exc:  # any build or load failure means: use the PyTorch fallback
        logger.warning("vivace: native %s failed to build or load (%s); using PyTorch code", source.name, exc)
        return False
    logger.info("vivace: native %s ready in %.1f s (built once per source, then cached)", source.name,
                time.perf_counter() - start)
    return True


@contextlib.contextmanager
def _building(build_dir: Path):
    """Holds ``build_dir``'s build lock: an OS file lock, which ends with its holder, so a
    process killed mid-build leaves no lock behind. torch's own lock file (``lock``, created by
    the builder and removed when it is done, which a killed builder never does) found while we
    hold ours was left by a dead builder: it is removed, or every later load would wait on it."""
    with open(build_dir / ".vivace-build.lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("vivace: removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
