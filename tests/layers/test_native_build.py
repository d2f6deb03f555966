"""The native libraries' build lock: a builder killed mid-build must not leave later loads
waiting forever on torch's lock file."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

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
