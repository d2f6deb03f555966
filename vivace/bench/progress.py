"""A one-line progress bar on stderr, redrawn as requests finish."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from vivace.bench.client import RequestResult


class ProgressBar:
    """Counts finished requests out of `total`; draws nothing when disabled."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.total = max(total, 1)
        self.enabled = enabled
        self.stream = stream
        self.width = width
        self.done = 0
        self.failed = 0
        self.started = time.perf_counter()

    def update(self, result: RequestResult) -> None:
        """Count one finished request and redraw."""
        self.done += 1
        self.failed += not result.success
        if self.enabled:
            filled = self.width * min(self.done, self.total) // self.total
            bar = "#" * filled + "." * (self.width - filled)
            elapsed = time.perf_counter() - self.started
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} failed {self.failed} {elapsed:6.1f}s")
            self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
