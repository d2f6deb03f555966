"""Latency statistics, defined as `vllm bench serve` defines them (docs/bench.md).

TTFT: request sent -> first chunk with content. ITL: gaps between consecutive content
chunks, pooled over all requests. TPOT: (E2E - TTFT) / (output tokens - 1) per request
with more than one output token. E2E: request sent -> last byte. Percentiles interpolate
linearly (numpy's default); std is the population standard deviation.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from vivace.bench.client import RequestResult

PERCENTILES = (90, 95, 99)


@dataclass(frozen=True)
class Distribution:
    """Summary of a set of durations, in milliseconds (NaN when the set is empty)."""

    count: int
    mean: float
    median: float
    std: float
    p90: float
    p95: float
    p99: float
    max: float


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None means no bound on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        """Whether a successful request met every bound (TPOT of a 1-token reply is 0)."""
        checks = ((self.ttft_ms, result.ttft), (self.tpot_ms, request_tpot(result) or 0.0), (self.e2e_ms, result.e2e))
        return all(bound is None or value * 1000 <= bound for bound, value in checks)


@dataclass(frozen=True)
class Summary:
    """Everything the report prints for one run."""

    duration_s: float
    completed: int
    failed: int
    errors: dict[str, int]
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    prompt_token_mismatches: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    slo: Slo | None = field(default=None)


def describe(seconds: list[float]) -> Distribution:
    """Count, mean, median, std, p90/p95/p99 and max of `seconds`, in milliseconds."""
    if not seconds:
        nan = math.nan
        return Distribution(0, nan, nan, nan, nan, nan, nan, nan)
    ms = np.asarray(seconds, dtype=float) * 1000
    p90, p95, p99 = (float(np.percentile(ms, q)) for q in PERCENTILES)
    return Distribution(len(ms), float(ms.mean()), float(np.median(ms)), float(ms.std()), p90, p95, p99, float(ms.max()))


def request_tpot(result: RequestResult) -> float | None:
    """(E2E - TTFT) / (output tokens - 1) in seconds, or None for fewer than 2 tokens."""
    if result.ttft is None or result.output_tokens < 2:
        return None
    return (result.e2e - result.ttft) / (result.output_tokens - 1)


def parse_slo(text: str) -> Slo:
    """Parse 'ttft=200ms,tpot=50ms[,e2e=2s]' (units ms or s; ms when none). Raises
    ValueError on an unknown metric or a malformed value."""
    bounds: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip().lower()
        if name not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"unknown SLO metric {name!r}: use ttft, tpot or e2e")
        value = value.strip().lower()
        if value.endswith("ms"):
            bounds[name + "_ms"] = float(value[:-2])
        elif value.endswith("s"):
            bounds[name + "_ms"] = float(value[:-1]) * 1000
        else:
            bounds[name + "_ms"] = float(value)
    return Slo(**bounds)


def summarize(results: list[RequestResult], duration_s: float, slo: Slo | None = None) -> Summary:
    """Aggregate measured requests over a run that lasted `duration_s` seconds."""
    ok = [result for result in results if result.success]
    failed = [result for result in results if not result.success]
    input_tokens = sum(result.prompt_tokens or result.expected_prompt_tokens or 0 for result in ok)
    output_tokens = sum(result.output_tokens for result in ok)
    tpots = [tpot for tpot in map(request_tpot, ok) if tpot is not None]
    per_second = 1 / duration_s if duration_s > 0 else math.nan
    return Summary(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(failed),
        errors=dict(Counter(result.error_kind or "unknown" for result in failed)),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) * per_second,
        output_throughput=output_tokens * per_second,
        total_token_throughput=(input_tokens + output_tokens) * per_second,
        goodput=sum(slo.met_by(result) for result in ok) * per_second if slo else None,
        prompt_token_mismatches=sum(prompt_mismatch(result) for result in ok),
        ttft=describe([result.ttft for result in ok if result.ttft is not None]),
        tpot=describe(tpots),
        itl=describe([gap for result in ok for gap in result.itl]),
        e2e=describe([result.e2e for result in ok]),
        slo=slo,
    )


def prompt_mismatch(result: RequestResult) -> bool:
    """Whether the server counted a different prompt length than the one built."""
    expected, counted = result.expected_prompt_tokens, result.prompt_tokens
    return expected is not None and counted is not None and expected != counted
