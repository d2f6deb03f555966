"""The native libraries' build lock: a builder killed mid-build must not leave later loads
waiting forever on torch's lock file. A process builds each library once, however many threads
ask for it, and ``prebuild`` starts every library the modules load."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vivace.layers import native
from vivace.layers.native import _building


def _hold_then_die(build_dir: str, ready) -> None:
    with _building(Path(build_dir)):
        (Path(build_dir) / "lock").touch()  # what torch's builder creates, then never removes
        ready.set()
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_lock_left_by_a_killed_builder_is_removed(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    builder = context.Process(target=_hold_then_die, args=(str(tmp_path), ready))
    builder.start()
    builder.join(timeout=60)
    assert ready.is_set() and builder.exitcode == -signal.SIGKILL
    assert (tmp_path / "lock").exists()
    with _building(tmp_path):  # the dead builder's OS lock went with it: no wait here
        assert not (tmp_path / "lock").exists()


def test_the_build_lock_is_exclusive(tmp_path: Path) -> None:
    import fcntl

    with _building(tmp_path):
        with open(tmp_path / ".vivace-build.lock", "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                taken = True
            except BlockingIOError:
                taken = False
    assert not taken


def test_concurrent_loads_of_one_library_build_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Threads asking for the same library share one build and its result (here a failed one,
    which fails fast and must still fall back for every caller)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(native.FORCE_FALLBACK_ENV, raising=False)
    source = tmp_path / "broken.cpp"
    source.write_text("#error this library does not build\n")
    results: list[bool] = []
    start = threading.Barrier(4)

    def load() -> None:
        start.wait()
        results.append(native.load_library(source))

    with caplog.at_level(logging.INFO, logger=native.__name__):
        threads = [threading.Thread(target=load) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert results == [False] * 4
    assert sum("building native broken.cpp" in r.message for r in caplog.records) == 1
    assert sum("broken.cpp failed to build" in r.message for r in caplog.records) == 1


def test_prebuild_covers_what_the_modules_load() -> None:
    """Every library is in ``LIBRARIES``, and a prebuilt one is the one the modules use."""
    from vivace import kernels
    from vivace.engine import aot_decode
    from vivace.layers import decode_attention, fused, prefill_attention

    assert {lib.source.name for lib in native.LIBRARIES.values()} == {
        "decode_attention.cpp", "prefill_attention.cpp", "fused.cpp", "packed_linear.cpp", "quant_gemm.cpp",
        "aoti_runner.cpp"}
    for thread in native.prebuild():
        thread.join(timeout=600)
    assert native.load("decode_attention") == (decode_attention.BACKEND == "native")
    assert native.load("prefill_attention") == (prefill_attention.BACKEND == "native")
    assert native.load("fused") == fused.NATIVE
    assert native.load("quant_gemm") == (kernels.quant_linear_kernel() is not None)
    assert native.load("aoti_runner") == aot_decode._native_runner()


_BUILD_IN_A_NEW_PROCESS = """
import sys
from pathlib import Path
from vivace.layers import native
assert native._build_and_load(Path(sys.argv[1]), native.Target(()), Path(sys.argv[2]), "tiny")
"""


def test_another_checkout_of_the_same_sources_reuses_the_build(tmp_path: Path) -> None:
    """The build reads a copy of the sources kept in its build directory, so a later process
    building the same bytes from another checkout (a fresh clone, a worktree, CI) loads the first
    one's library instead of compiling it again."""
    build_dir = tmp_path / "kernels" / "tiny"
    env = {k: v for k, v in os.environ.items() if k != native.FORCE_FALLBACK_ENV}
    built = []
    for checkout in ("one", "two"):
        (tmp_path / checkout).mkdir()
        (tmp_path / checkout / "tiny.h").write_text("#define SEVEN 7\n")
        source = tmp_path / checkout / "tiny.cpp"
        source.write_text('#include "tiny.h"\nextern "C" int vivace_test_seven() { return SEVEN; }\n')
        subprocess.run([sys.executable, "-c", _BUILD_IN_A_NEW_PROCESS, str(source), str(build_dir)], env=env,
                       check=True, timeout=300)
        (library,) = build_dir.glob("*.so")
        built.append(library.stat().st_mtime_ns)
    assert built[0] == built[1]


_LOAD_IN_A_NEW_PROCESS = """
import sys
from pathlib import Path
from vivace.layers import native
assert native.load_library(Path(sys.argv[1]))
"""


def test_a_cache_reached_through_a_symlink_reuses_the_build(tmp_path: Path) -> None:
    """The same kernels directory named through a symlink (as a child given a cache of links
    sees it) loads the library built before instead of compiling it again."""
    kernels = tmp_path / "cache" / "vivace" / "kernels"
    kernels.mkdir(parents=True)
    (tmp_path / "link" / "vivace").mkdir(parents=True)
    (tmp_path / "link" / "vivace" / "kernels").symlink_to(kernels, target_is_directory=True)
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int vivace_test_eight() { return 8; }\n')
    built = []
    for cache in ("cache", "link", "cache"):
        env = {k: v for k, v in os.environ.items() if k != native.FORCE_FALLBACK_ENV}
        env["XDG_CACHE_HOME"] = str(tmp_path / cache)
        subprocess.run([sys.executable, "-c", _LOAD_IN_A_NEW_PROCESS, str(source)], env=env, check=True, timeout=300)
        (library,) = kernels.glob("*/*.so")
        built.append(library.stat().st_mtime_ns)
    assert built[0] == built[1] == built[2]
