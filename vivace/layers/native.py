"""Building and loading vivace's native op libraries (C++ files registering ``torch.ops.vivace``).

Each library (a C++ file, plus the headers beside it) is compiled once with ``torch.utils.cpp_extension`` into
``~/.cache/vivace/kernels/<name>-<hash of source, flags and torch version>`` (from a copy of the sources
kept there, so every checkout of the same sources shares the build) and loaded from
there by later processes. Callers fall back to PyTorch code when ``load_library`` says False.

A process builds (or loads) each library once: the first ``load_library`` of it runs the build
and later ones, from any thread, wait for and return its result. ``prebuild`` builds every
library of ``LIBRARIES`` on one thread per CPU (the compilers are subprocesses, so the builds run
in parallel), so a fresh start waits for about the sum of the builds over the cores, not the sum.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from vivace.cache import cache_dir

FORCE_FALLBACK_ENV = "VIVACE_KERNELS"  # "torch": use no native library
# -fopenmp: at::parallel_for is an OpenMP pragma in a header; without it an op runs on one thread.
AVX512_CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mf16c", "-mfma", "-fopenmp")
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c", "fma")
# A CPU with AVX2 but not the AVX-512 a library asks for builds the same source against SIMDe's
# AVX-512 intrinsics (the simde-py package's headers), which run on pairs of 256-bit registers:
# SIMDE_HEADER, force-included, takes SIMDe's aliases and adds the few it lacks.
SIMDE_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
SIMDE_CPU_FLAGS = ("avx2", "fma", "f16c")
SIMDE_HEADER = Path(__file__).resolve().with_name("simde_avx512.h")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Library:
    """One native library: its C++ source, compiler flags and the CPU features it needs."""

    source: Path
    cflags: tuple[str, ...] = ()
    cpu_flags: tuple[str, ...] = ()
    # Not needed before the server is ready (prebuild starts it after the others).
    late: bool = False
    # Built through SIMDe where the CPU lacks the AVX-512 of ``cpu_flags``; False where the
    # PyTorch fallback is faster there.
    simde: bool = True


_PACKAGE = Path(__file__).resolve().parent.parent
LIBRARIES = {
    "decode_attention": Library(_PACKAGE / "layers" / "decode_attention.cpp", AVX512_CFLAGS, AVX512_CPU_FLAGS),
    "prefill_attention": Library(_PACKAGE / "layers" / "prefill_attention.cpp", AVX512_CFLAGS, AVX512_CPU_FLAGS),
    "fused": Library(_PACKAGE / "layers" / "fused.cpp", AVX512_CFLAGS, AVX512_CPU_FLAGS),
    "packed_linear": Library(_PACKAGE / "layers" / "packed_linear.cpp", ("-O2",)),
    "quant_gemm": Library(_PACKAGE / "kernels" / "quant_gemm.cpp", (*AVX512_CFLAGS, "-mavx512vnni"),
                          (*AVX512_CPU_FLAGS, "avx512_vnni")),
    # Runs the AOTInductor decode package with the GIL released (vivace.engine.aot_decode).
    # Needed once the background compile hands over its package: built after the others.
    "aoti_runner": Library(_PACKAGE / "engine" / "aoti_runner.cpp", ("-O2",), late=True),
}

# This process's build (or load) of each build directory: done once, shared by every caller.
_builds: dict[Path, Future[bool]] = {}
_builds_lock = threading.Lock()


@functools.cache
def simde_include() -> str | None:
    """The directory of SIMDe's headers, or None without the simde-py package."""
    try:
        import simde_py
    except ModuleNotFoundError:
        return None
    return str(simde_py.get_include())


@functools.cache
def _simde_version() -> str:
    return importlib.metadata.version("simde-py")


@dataclass(frozen=True)
class Target:
    """How a library is compiled on this CPU: its flags, and for SIMDe the headers that come
    with it (``includes``: directories, ``extra``: files copied beside the source)."""

    cflags: tuple[str, ...]
    includes: tuple[str, ...] = ()
    extra: tuple[Path, ...] = ()


def target(cflags: tuple[str, ...], cpu_flags: tuple[str, ...], simde: bool = True) -> Target | None:
    """``cflags`` where the CPU has ``cpu_flags``; for an AVX-512 library on an AVX2 CPU, the
    SIMDe build (where ``simde``); else None (the PyTorch fallback)."""
    if cpu_has(cpu_flags):
        return Target(cflags)
    if simde and any(flag.startswith("avx512") for flag in cpu_flags):
        return simde_target()
    return None


def simde_target() -> Target | None:
    """The SIMDe build's flags and headers; None on a CPU without AVX2, FMA and F16C, or
    without the simde-py package."""
    if not cpu_has(SIMDE_CPU_FLAGS) or (include := simde_include()) is None:
        return None
    return Target((*SIMDE_CFLAGS, "-include", SIMDE_HEADER.name, f"-DVIVACE_SIMDE={_simde_version()}"),
                  (include,), (SIMDE_HEADER,))


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


def load(name: str) -> bool:
    """``load_library`` of ``LIBRARIES[name]``."""
    lib = LIBRARIES[name]
    return load_library(lib.source, lib.cflags, lib.cpu_flags, lib.simde)


def prebuild(names: tuple[str, ...] | None = None, workers: int | None = None) -> list[threading.Thread]:
    """Start building and loading the libraries ``names`` (default: all of ``LIBRARIES``) on
    ``workers`` threads (default: one per CPU this process may use), the largest source first (the
    ``late`` ones after all others), so that the longest build is not slowed by all the others at
    once; returns the threads. Every library is claimed before this returns: a ``load`` of one
    waits for its build here."""
    libraries = sorted((LIBRARIES[name] for name in names or LIBRARIES),
                       key=lambda lib: (lib.late, -lib.source.stat().st_size))
    queue = collections.deque(run for claimed in (_claim(lib.source, lib.cflags, lib.cpu_flags, lib.simde) for lib in libraries)
                              if claimed is not None and (run := claimed[1]) is not None)

    def work() -> None:
        while queue:
            try:
                run = queue.popleft()
            except IndexError:  # another worker took the last one
                return
            with contextlib.suppress(Exception):  # logged, and raised to whoever waits for it
                run()

    count = min(workers or len(os.sched_getaffinity(0)), len(queue))
    threads = [threading.Thread(target=work, name=f"vivace-build-{i}", daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def load_library(source: Path, cflags: tuple[str, ...] = (), cpu_flags: tuple[str, ...] = (),
                 simde: bool = True) -> bool:
    """Build ``source`` (or reuse its cached build) and load it into this process, which runs its
    op registrations. False, and nothing loaded, when ``VIVACE_KERNELS=torch``, the CPU lacks one
    of ``cpu_flags``, or the build or load fails (logged). Once per process and build: a second
    call, from any thread, waits for the first one's result."""
    claimed = _claim(source, cflags, cpu_flags, simde)
    if claimed is None:
        return False
    build, run = claimed
    if run is not None:
        run()
    return build.result()


def _claim(source: Path, cflags: tuple[str, ...], cpu_flags: tuple[str, ...], simde: bool = True
           ) -> tuple[Future[bool], Callable[[], None] | None] | None:
    """None when the library is not to be used here; else the future of this process's build of
    it and, for the first caller only, the function that runs that build."""
    built = None if os.environ.get(FORCE_FALLBACK_ENV, "").lower() == "torch" else target(cflags, cpu_flags, simde)
    if built is None:
        return None
    # The headers beside the source (and SIMDe's force-included one) are part of what is built.
    headers = b"".join(h.read_bytes() for h in _headers(source, built))
    key = source.read_bytes() + headers + " ".join(built.cflags).encode() + torch.__version__.encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    # Resolved: ninja's build file names the build directory, so the same cache reached through
    # a symlink would otherwise build everything again (and again for the other path after).
    build_dir = cache_dir("kernels").resolve() / f"{source.stem}-{digest}"
    with _builds_lock:
        if build_dir in _builds:
            return _builds[build_dir], None
        build = _builds[build_dir] = Future()

    def run() -> None:
        try:
            build.set_result(_build_and_load(source, built, build_dir, digest))
        except BaseException as exc:  # the waiting callers raise it too
            build.set_exception(exc)
            raise

    return build, run


def _headers(source: Path, built: Target) -> list[Path]:
    return sorted({*source.parent.glob("*.h"), *built.extra})


def _build_and_load(source: Path, built: Target, build_dir: Path, digest: str) -> bool:
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not any(build_dir.glob("*.so")):
        logger.info("vivace: building native %s (once per source and machine; tens of seconds)...", source.name)
    try:
        from torch.utils.cpp_extension import load
        with _building(build_dir):
            copy = _source_copy(source, _headers(source, built), build_dir)
            load(name=f"vivace_{source.stem}_{digest}", sources=[str(copy)], extra_cflags=list(built.cflags),
                 extra_include_paths=[str(copy.parent), *built.includes],
                 build_directory=str(build_dir), is_python_module=False, verbose=False)
    except Exception as exc:  # any build or load failure means: use the PyTorch fallback
        logger.warning("vivace: native %s failed to build or load (%s); using PyTorch code", source.name, exc)
        return False
    logger.info("vivace: native %s ready in %.1f s (built once per source, then cached)", source.name,
                time.perf_counter() - start)
    return True


def _source_copy(source: Path, headers: list[Path], build_dir: Path) -> Path:
    """``source`` and its ``headers``, copied into ``build_dir/src`` (a file rewritten only
    when its bytes differ), and the copy's path. The build reads the copy: ninja's build file names
    the sources' paths, so building from the checkout itself would rebuild the same bytes for every
    checkout of the repository (a fresh clone, a worktree, CI)."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for original in (source, *headers):
        copy = src / original.name
        data = original.read_bytes()
        if not copy.exists() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return src / source.name


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
