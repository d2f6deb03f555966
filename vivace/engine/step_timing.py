"""Timing cheap enough to leave on: where each engine step, each hand-off to the event loop,
each garbage collection and each piece of server-side request work spends its time.

Every kind of event has one :class:`TimingLog`: a ring of its last events (for tracing a stall
back to its cause) and cumulative histograms of its durations (for ``/metrics``). Recording is
a tuple append and a bisect per duration, done by the thread that did the work; readers (a
scrape, the ``/debug/timings`` endpoint) copy what they need. Timestamps are
``time.perf_counter()``: on Linux the monotonic clock that other processes on the machine
read too, so a client can line its own token arrival times up with the server's events.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

# Seconds; the upper bounds of the histogram buckets (Prometheus ``le``), +Inf implied.
DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015,
                    0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
STEP_PHASES = ("schedule", "forward", "sample", "emit", "finish")


class DurationHistogram:
    """Counts of observations per bucket, and their sum. One writer; readers take
    :meth:`snapshot`, which is consistent enough for monitoring (a racing observation may be
    in the counts but not yet in the sum)."""

    def __init__(self, buckets: Sequence[float] = DURATION_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last counts values above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def snapshot(self) -> tuple[list[tuple[float, int]], float]:
        """Cumulative ``(upper bound, count)`` pairs ending with ``(inf, total)``, and the sum."""
        counts, total = list(self.counts), self.sum
        cumulative, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), counts):
            running += count
            cumulative.append((bound, running))
        return cumulative, total


class TimingLog:
    """The last ``capacity`` events of one kind, each a tuple of ``fields`` values, and a
    histogram of each field named in ``durations`` (a duration in seconds), per ``label``."""

    def __init__(self, fields: Sequence[str], durations: Sequence[str], capacity: int = 4096) -> None:
        self.fields = tuple(fields)
        self.durations = tuple(durations)
        self._duration_index = [self.fields.index(name) for name in self.durations]
        self.events: deque[tuple] = deque(maxlen=capacity)
        self.histograms: dict[str, DurationHistogram] = {name: DurationHistogram() for name in self.durations}

    def record(self, *values: Any) -> None:
        """Appends one event; ``values`` line up with ``fields``."""
        self.events.append(values)
        for name, index in zip(self.durations, self._duration_index):
            self.histograms[name].observe(values[index])

    def rows(self, since: float = float("-inf")) -> list[dict[str, Any]]:
        """The events whose first field (their start time) is at or after ``since``, as dicts."""
        return [dict(zip(self.fields, event)) for event in list(self.events) if event[0] >= since]


class StepTimings:
    """The engine loop's logs: ``steps`` (each phase of each step, and what the step held),
    ``handoffs`` (from the engine thread's hand-off to the event loop running it) and ``gc``
    (collections, in any thread of the process, while :meth:`watch_gc` is on)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.steps = TimingLog(("start", *STEP_PHASES, "total", "decode_tokens", "prompt_tokens",
                                "prompt_budget", "path"), (*STEP_PHASES, "total"), capacity)
        self.handoffs = TimingLog(("start", "lag"), ("lag",), capacity)
        self.gc = TimingLog(("start", "pause", "generation"), ("pause",), capacity)
        self._gc_start = 0.0

    def record_step(self, marks: Sequence[float], decode_tokens: int, prompt_tokens: int,
                    prompt_budget: int, path: str) -> None:
        """One step, from ``marks``: the start and the end of each of :data:`STEP_PHASES`;
        ``path``: how it ran (``rows`` of the decode step, or ``prefill``)."""
        phases = [b - a for a, b in zip(marks, marks[1:])]
        self.steps.record(marks[0], *phases, marks[-1] - marks[0], decode_tokens, prompt_tokens,
                          prompt_budget, path)

    def record_handoff(self, sent_at: float) -> None:
        """Called on the event loop when work handed over at ``sent_at`` runs."""
        self.handoffs.record(sent_at, time.perf_counter() - sent_at)

    def watch_gc(self) -> None:
        """Records every garbage collection of this process from now on (until :meth:`unwatch_gc`)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # Collections never overlap (the collector holds the GIL), so one start time serves.
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc.record(self._gc_start, time.perf_counter() - self._gc_start, info["generation"])


@contextlib.contextmanager
def timed(log: TimingLog) -> Iterator[None]:
    """Records into ``log`` (fields: start, seconds) how long the ``with`` body ran; time spent
    at ``await`` points counts too, so time only synchronous work with it."""
    start = time.perf_counter()
    try:
        yield
    finally:
        log.record(start, time.perf_counter() - start)


def work_log(capacity: int = 4096) -> TimingLog:
    """A log of one kind of work: when each piece started and how many seconds it took."""
    return TimingLog(("start", "seconds"), ("seconds",), capacity)
