"""Time limits of requests: how long one may wait to be scheduled, and how long it may run.

The engine loop asks :meth:`DeadlineQueue.pop_expired` before every step and ends each
expired request with the matching error, freeing its KV blocks at once.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadlines:
    """Limits of one request in seconds from its arrival; None means no limit.

    ``max_queue_delay``: the request must be first scheduled by then (preempted requests,
    already served once, are exempt). ``timeout``: it must have finished by then.
    """

    max_queue_delay: float | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_queue_delay", "timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")


class QueueTimeoutError(RuntimeError):
    """The request waited longer than its ``max_queue_delay`` without being scheduled."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its ``timeout``."""


class DeadlineQueue:
    """Pending deadlines in time order. Entries of requests that ended earlier are harmless:
    the caller skips requests it no longer knows."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str, bool]] = []  # (instant, request id, is queue deadline)

    def add(self, request_id: str, arrival: float, deadlines: Deadlines) -> None:
        """Track ``request_id``'s limits, counted from ``arrival`` (a perf_counter instant)."""
        if deadlines.max_queue_delay is not None:
            heapq.heappush(self._heap, (arrival + deadlines.max_queue_delay, request_id, True))
        if deadlines.timeout is not None:
            heapq.heappush(self._heap, (arrival + deadlines.timeout, request_id, False))

    def pop_expired(self, now: float) -> list[tuple[str, bool]]:
        """(request id, whether it is the queue deadline) of every deadline up to ``now``."""
        expired = []
        while self._heap and self._heap[0][0] <= now:
            _, request_id, is_queue = heapq.heappop(self._heap)
            expired.append((request_id, is_queue))
        return expired
