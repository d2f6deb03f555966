"""Admission control: whether a request may start now, before any engine work.

In order: the server-wide bound on requests waiting for their first token (503), then the
caller's key limits: concurrency, requests per minute, tokens per minute (429). Every refusal
carries a Retry-After. Tokens per minute count the prompt at admission and the generated
tokens when the request ends, so a key may run into debt and then waits for the refill.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vivace.server.errors import APIError
from vivace.server.tiers import Tier

if TYPE_CHECKING:
    from vivace.server.generation import EngineRequest

REJECTION_REASONS = ("max_waiting_requests", "max_concurrency", "requests_per_minute",
                     "tokens_per_minute")


class TokenBucket:
    """Holds up to ``per_minute`` units and refills continuously at ``per_minute / 60`` a second."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.level = per_minute
        self.updated = now

    def wait_time(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` units (at most a full bucket) are there; 0 when they are now."""
        self._refill(now)
        missing = min(cost, self.capacity) - self.level
        return max(missing, 0.0) / self.rate

    def take(self, cost: float, now: float) -> None:
        """Remove ``cost`` units, even into debt."""
        self._refill(now)
        self.level -= cost

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now


@dataclass
class KeyUsage:
    """What one key has in flight and its rate buckets (None when its tier has no such limit)."""

    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0


@dataclass(eq=False)
class Ticket:
    """One admitted HTTP request. :meth:`release` it exactly when it ends (idempotent)."""

    admission: Admission
    usage: KeyUsage
    jobs: list[EngineRequest]
    released: bool = field(default=False, init=False)

    @property
    def waiting(self) -> bool:
        """True until one of its engine requests has produced output."""
        return all(job.last is None for job in self.jobs)

    def release(self) -> None:
        """Frees its concurrency slot and charges its generated tokens to its key."""
        if self.released:
            return
        self.released = True
        self.usage.in_flight -= 1
        if self.usage.tokens is not None:
            self.usage.tokens.take(sum(job.completion_tokens for job in self.jobs), self.admission.clock())
        self.admission.live.discard(self)


def _retry_after(seconds: float) -> int:
    return max(1, math.ceil(seconds))


class Admission:
    """Admits or refuses requests for one server. ``on_reject(reason)`` is told each refusal
    (a reason of :data:`REJECTION_REASONS`); ``clock`` is monotonic seconds."""

    def __init__(self, max_waiting_requests: int | None, on_reject: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.on_reject = on_reject
        self.clock = clock
        self.live: set[Ticket] = set()
        self.keys: dict[str, KeyUsage] = {}

    @property
    def num_waiting(self) -> int:
        """Admitted requests without any output yet (queued, or having their prompt computed)."""
        return sum(1 for ticket in self.live if ticket.waiting)

    def admit(self, key: str, tier: Tier, jobs: list[EngineRequest]) -> Ticket:
        """A ticket for ``jobs`` (one HTTP request) of ``key``; raises APIError 503 or 429 with
        Retry-After when it may not start now."""
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            self._reject("max_waiting_requests", 503, 1,
                         f"The server has {self.num_waiting} requests waiting; retry shortly")
        usage = self.keys.get(key) or self.keys.setdefault(key, self._usage(tier))
        if tier.max_concurrency is not None and usage.in_flight >= tier.max_concurrency:
            self._reject("max_concurrency", 429, 1,
                         f"This key has {usage.in_flight} requests in flight, its tier's limit")
        now = self.clock()
        prompt_tokens = sum(len(job.prompt_ids) for job in jobs)
        for reason, bucket, cost in (("requests_per_minute", usage.requests, 1),
                                     ("tokens_per_minute", usage.tokens, prompt_tokens)):
            wait = bucket.wait_time(cost, now) if bucket is not None else 0.0
            if wait > 0:
                self._reject(reason, 429, _retry_after(wait),
                             f"Rate limit of this key's tier reached ({reason.replace('_', ' ')})")
        for bucket, cost in ((usage.requests, 1), (usage.tokens, prompt_tokens)):
            if bucket is not None:
                bucket.take(cost, now)
        usage.in_flight += 1
        ticket = Ticket(self, usage, jobs)
        self.live.add(ticket)
        return ticket

    def _usage(self, tier: Tier) -> KeyUsage:
        now = self.clock()
        return KeyUsage(
            TokenBucket(tier.requests_per_minute, now) if tier.requests_per_minute else None,
            TokenBucket(tier.tokens_per_minute, now) if tier.tokens_per_minute else None)

    def _reject(self, reason: str, status: int, retry_after: int, message: str) -> None:
        self.on_reject(reason)
        raise APIError(status, f"{message}; retry after {retry_after} s", code=reason,
                       retry_after=retry_after)
