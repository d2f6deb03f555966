"""Prometheus metrics of one server, named like vLLM's with the ``vivace:`` prefix.

Each app owns its registry: request histograms and counters are recorded as requests end
(or are refused); engine gauges (running, waiting, KV usage), the preemption count, the
prefix-cache and the speculative-decoding counters are read from ``engine.stats()`` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vivace.server.admission import REJECTION_REASONS

if TYPE_CHECKING:
    from vivace.server.generation import EngineRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineStatsCollector(Collector):
    """Gauges read from the engine when scraped (zeros while it is still loading)."""

    def __init__(self, stats: Callable[[], Any | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        values = {
            "num_requests_running": stats.num_running if stats else 0,
            "num_requests_waiting": stats.num_waiting if stats else 0,
            "kv_cache_usage_perc": stats.kv_usage if stats else 0.0,
        }
        helps = {
            "num_requests_running": "Requests in the engine's running batch.",
            "num_requests_waiting": "Requests waiting to be scheduled.",
            "kv_cache_usage_perc": "Fraction of KV cache blocks in use (0 to 1).",
        }
        for name, value in values.items():
            yield GaugeMetricFamily(f"vivace:{name}", helps[name], value=value)
        yield CounterMetricFamily("vivace:num_preemptions", "Cumulative preemptions.",
                                  value=stats.num_preemptions if stats else 0)
        yield CounterMetricFamily("vivace:prefix_cache_queries", "Tokens looked up in the prefix "
                                  "cache at admission.", value=stats.prefix_queries if stats else 0)
        yield CounterMetricFamily("vivace:prefix_cache_hits", "Of those, tokens found cached.",
                                  value=stats.prefix_hits if stats else 0)
        yield from _speculative_metrics(stats)


def _speculative_metrics(stats: Any | None) -> Iterator[Metric]:
    """Speculative decoding, named like vLLM's: counters, and the lifetime ratios as gauges."""
    steps = stats.spec_steps if stats else 0
    proposed = stats.spec_proposed if stats else 0
    accepted = stats.spec_accepted if stats else 0
    yield CounterMetricFamily("vivace:spec_decode_num_drafts", "Verify steps that carried proposed "
                              "tokens (one per request per step).", value=steps)
    yield CounterMetricFamily("vivace:spec_decode_num_draft_tokens", "Proposed tokens verified.",
                              value=proposed)
    yield CounterMetricFamily("vivace:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                              value=accepted)
    yield GaugeMetricFamily("vivace:spec_decode_acceptance_rate", "Accepted / proposed tokens since "
                            "start (0 before any proposal).", value=accepted / proposed if proposed else 0.0)
    yield GaugeMetricFamily("vivace:spec_decode_mean_accepted_length", "Tokens emitted per verify step "
                            "since start: accepted ones plus the target's own (0 before any).",
                            value=(accepted + steps) / steps if steps else 0.0)


class ServerMetrics:
    """The metrics of one app; ``stats`` returns the engine's EngineStats or None."""

    def __init__(self, stats: Callable[[], Any | None]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"vivace:{name}", doc, buckets=buckets, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = histogram("request_queue_time_seconds", "Time waiting to be scheduled.")
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = histogram("request_decode_time_seconds", "First token to finish.")
        self.prompt_tokens = Counter("vivace:prompt_tokens", "Prompt tokens processed.",
                                     registry=registry)
        self.generation_tokens = Counter("vivace:generation_tokens", "Tokens generated.",
                                         registry=registry)
        self.request_success = Counter("vivace:request_success", "Finished choices by reason.",
                                       ["finished_reason"], registry=registry)
        self.rejected = Counter("vivace:request_rejected", "Requests refused at admission (429 "
                                "or 503), by reason.", ["reason"], registry=registry)
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason=reason)
        self.timed_out = Counter("vivace:request_timeout", "Requests ended by a deadline: 'queue' "
                                 "(max queue delay) or 'request' (request timeout).", ["kind"],
                                 registry=registry)
        for kind in ("queue", "request"):
            self.timed_out.labels(kind=kind)
        registry.register(_EngineStatsCollector(stats))

    def record_rejection(self, reason: str) -> None:
        """Counts one request refused at admission for ``reason``."""
        self.rejected.labels(reason=reason).inc()

    def record_timeout(self, kind: str) -> None:
        """Counts one request ended by its ``kind`` of deadline: "queue" or "request"."""
        self.timed_out.labels(kind=kind).inc()

    def record_request(self, request: EngineRequest) -> None:
        """Records one ended request (finished or aborted)."""
        self.generation_tokens.inc(request.completion_tokens)
        for choice in request.choices:
            self.request_success.labels(finished_reason=choice.finish_reason or "abort").inc()
        out = request.last
        if out is None:
            return
        self.prompt_tokens.inc(out.prompt_tokens)
        t = out.timings
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
        for earlier, later in zip(t.token_times, t.token_times[1:]):
            self.itl.observe(later - earlier)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
            self.queue.observe(t.queue_time)
            self.prefill.observe(t.prefill_time)
            self.decode.observe(t.decode_time)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
