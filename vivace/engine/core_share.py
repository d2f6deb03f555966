"""Step threads that give way while other work holds some of the cores, and take them back when
they come free (Linux; elsewhere the thread count stays as configured).

A CPU step splits each op across its threads and joins them at a barrier: when another process
holds a core, one of the step's threads waits for a time slice at every barrier. Two threads
beside one process spinning on the CPU (the default model): a 4 ms step takes ~1.2 s (a spinner
that never enters the kernel is preempted only at the scheduler's tick), and ~10 ms at the median
with p99 150-250 ms beside one that makes system calls; one thread there: 6-8 ms.

So the engine thread, between two steps and at most every :data:`CHECK_INTERVAL_S` (at once after
a slow step), reads how long this process's threads ran and waited for a core (the kernel's
``schedstat``) and how long the machine's cores idled (``/proc/stat``). Threads that waited
:data:`WAITING_TO_SHRINK` on average drop that many step threads. A dropped thread comes back
when, while the steps kept this process busy, a core idled :data:`IDLE_TO_GROW` of the window
(a core the other work left); a return that the other work answers at once doubles the wait
before the next (:data:`GROW_HOLD_S`, up to :data:`MAX_GROW_HOLD_S`), since each costs a slow
step. The thread count never changes a result (every kernel sums in an order of its own,
whatever the threads).
"""

from __future__ import annotations

import math
import os
import time

CHECK_INTERVAL_S = 0.25
# Threads of this process waiting for a core, on average over a check's window, that cost the
# steps a thread: beside one busy process, two step threads wait ~0.6 or more; alone, ~0.
WAITING_TO_SHRINK = 0.4
# The share of a window that a core must idle for a dropped thread to come back, in a window
# where this process ran at least BUSY_TO_GROW of its current threads' worth.
IDLE_TO_GROW = 0.7
BUSY_TO_GROW = 0.8
# Seconds after a drop before a thread may come back; doubled, up to MAX_GROW_HOLD_S, by each
# drop that follows a return within REGRET_S; back to GROW_HOLD_S after a drop past it.
GROW_HOLD_S = 1.0
MAX_GROW_HOLD_S = 60.0
REGRET_S = 10.0
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
TASKS = "/proc/self/task"


class ThreadWaits:
    """Seconds this process's threads have run on a core and spent runnable but waiting for one,
    each summed over the threads, from each thread's ``schedstat``, whose files stay open between
    reads (an open costs ~15 us; a read lists the threads, opening only new ones' files: ~25 us
    for a server's dozen). ``read`` gives None where the kernel does not say (not Linux, no
    schedstat)."""

    def __init__(self) -> None:
        self._files: dict[str, int] = {}
        self._last: dict[str, tuple[int, int]] = {}  # each thread's figures when last read
        self._ended = (0, 0)  # the last figures of threads that have ended, summed

    def read(self) -> tuple[float, float] | None:
        if not self._relist():
            return None
        for tid, fd in list(self._files.items()):
            try:
                fields = os.pread(fd, 128, 0).split()
                self._last[tid] = (int(fields[0]), int(fields[1]))
            except (OSError, IndexError, ValueError):  # the thread ended: its last figures stay
                self._forget(tid)
        ran = self._ended[0] + sum(figures[0] for figures in self._last.values())
        waited = self._ended[1] + sum(figures[1] for figures in self._last.values())
        return ran / 1e9, waited / 1e9

    def _relist(self) -> bool:
        try:
            tids = set(os.listdir(TASKS))
        except OSError:
            return False
        for tid in set(self._files) - tids:
            self._forget(tid)
        for tid in tids - set(self._files):
            try:
                self._files[tid] = os.open(f"{TASKS}/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue
        return bool(self._files)

    def _forget(self, tid: str) -> None:
        """Close an ended thread's file; its last figures join those of the threads ended before."""
        os.close(self._files.pop(tid))
        ran, waited = self._last.pop(tid, (0, 0))
        self._ended = (self._ended[0] + ran, self._ended[1] + waited)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


class IdleCores:
    """Seconds the machine's cores have idled, summed (``/proc/stat``'s first line: idle and
    iowait), from a file that stays open; ``read`` gives None where unreadable."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/stat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> float | None:
        if self._fd is None:
            return None
        try:
            fields = os.pread(self._fd, 256, 0).split()
            return (int(fields[4]) + int(fields[5])) / TICKS
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class CoreShare:
    """The step thread count for a process configured with ``threads``: :meth:`check`, called
    between steps, returns a new count when it should change, else None."""

    def __init__(self, threads: int) -> None:
        self.full = self.threads = threads
        self._waits, self._idle = ThreadWaits(), IdleCores()
        self.enabled = threads > 1 and self._waits.read() is not None and self._idle.read() is not None
        if not self.enabled:
            self.close()
        self._last: tuple[float, float, float, float] | None = None  # time, ran, waited, idled
        self._hold = GROW_HOLD_S
        self._grow_after = 0.0  # no return before this time
        self._grew_at = -math.inf

    def check(self, now: float | None = None) -> int | None:
        if not self.enabled:
            return None
        now = time.perf_counter() if now is None else now
        if self._last is not None and now - self._last[0] < CHECK_INTERVAL_S:
            return None
        figures, idled = self._waits.read(), self._idle.read()
        if figures is None or idled is None:
            return None
        last, self._last = self._last, (now, *figures, idled)
        if last is None:
            return None
        span = now - last[0]
        return self.decide((figures[1] - last[2]) / span, (idled - last[3]) / span, (figures[0] - last[1]) / span, now)

    def close(self) -> None:
        self._waits.close()
        self._idle.close()

    def decide(self, waiting: float, idle_cores: float, busy: float, now: float) -> int | None:
        """The new thread count after a window in which this process's threads waited for a core
        ``waiting`` threads' worth on average and ran ``busy`` threads' worth, and the machine's
        cores idled ``idle_cores``; None to keep the count."""
        if waiting >= WAITING_TO_SHRINK and self.threads > 1:
            threads = max(1, self.threads - math.ceil(waiting - WAITING_TO_SHRINK + 1e-9))
            regret = now - self._grew_at < REGRET_S
            self._hold = min(2 * self._hold, MAX_GROW_HOLD_S) if regret else GROW_HOLD_S
            self._grow_after = now + self._hold
        elif (self.threads < self.full and now >= self._grow_after and idle_cores >= IDLE_TO_GROW
              and busy >= BUSY_TO_GROW * self.threads):
            threads = min(self.full, self.threads + max(1, math.floor(idle_cores / IDLE_TO_GROW)))
            self._grew_at = now
        else:
            return None
        self.threads = threads
        return threads
