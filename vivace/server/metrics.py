"""Prometheus metrics of one server, named like vLLM's with the ``vivace:`` prefix.

Each app owns its registry: token counters move as outputs stream, request histograms and
counters are recorded as requests end (or are refused); engine gauges (running, waiting, KV
usage), the preemption count, the prefix-cache and the speculative-decoding counters are read
from ``engine.stats()`` at scrape time.
Where the time goes (engine step phases, hand-offs to the event loop, GC pauses, and the server's
own work: body parsing, chat template and tokenization, SSE writes) is recorded into
``vivace.engine.step_timing`` logs as it happens and exported as histograms at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from vivace.engine.step_timing import StepTimings, TimingLog, work_log
from vivace.server.admission import REJECTION_REASONS

if TYPE_CHECKING:
    from vivace.engine.outputs import RequestOutput
    from vivace.server.generation import EngineRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


_ENGINE_SERIES: tuple[tuple[str, type[Metric], str, Callable[[Any], float]], ...] = (
    ("num_requests_running", GaugeMetricFamily, "Requests in the engine's running batch.",
     lambda s: s.num_running),
    ("num_requests_waiting", GaugeMetricFamily, "Requests waiting to be scheduled.",
     lambda s: s.num_waiting),
    ("kv_cache_usage_perc", GaugeMetricFamily, "Fraction of KV cache blocks in use (0 to 1).",
     lambda s: s.kv_usage),
    ("num_preemptions", CounterMetricFamily, "Cumulative preemptions.", lambda s: s.num_preemptions),
    ("prefix_cache_queries", CounterMetricFamily, "Tokens looked up in the prefix cache at "
     "admission.", lambda s: s.prefix_queries),
    ("prefix_cache_hits", CounterMetricFamily, "Of those, tokens found cached.",
     lambda s: s.prefix_hits),
    # Speculative decoding, named like vLLM's: counters, and the lifetime ratios as gauges.
    ("spec_decode_num_drafts", CounterMetricFamily, "Verify steps that carried proposed tokens "
     "(one per request per step).", lambda s: s.spec_steps),
    ("spec_decode_num_draft_tokens", CounterMetricFamily, "Proposed tokens verified.",
     lambda s: s.spec_proposed),
    ("spec_decode_num_accepted_tokens", CounterMetricFamily, "Proposed tokens accepted.",
     lambda s: s.spec_accepted),
    ("spec_decode_acceptance_rate", GaugeMetricFamily, "Accepted / proposed tokens since start "
     "(0 before any proposal).", lambda s: s.spec_accepted / s.spec_proposed if s.spec_proposed else 0.0),
    ("spec_decode_mean_accepted_length", GaugeMetricFamily, "Tokens emitted per verify step since "
     "start: accepted ones plus the target's own (0 before any).",
     lambda s: (s.spec_accepted + s.spec_steps) / s.spec_steps if s.spec_steps else 0.0),
    # Of those, the proposals read off requests' predictions (OpenAI's usage counts, summed).
    ("accepted_prediction_tokens", CounterMetricFamily, "Tokens proposed from a request's prediction "
     "that verification accepted (and the output kept).", lambda s: s.prediction_accepted),
    ("rejected_prediction_tokens", CounterMetricFamily, "Tokens proposed from a request's prediction "
     "that verification rejected.", lambda s: s.prediction_rejected),
    ("cpu_step_threads", GaugeMetricFamily, "Threads the CPU steps run on now: fewer than configured "
     "while other work holds some of the cores (0 on a GPU).", lambda s: s.step_threads),
)


class EngineStatsCollector(Collector):
    """Engine series read when scraped. ``stats()`` gives, per engine, its label values (as
    many as ``labels`` names; none for a lone engine) and its EngineStats, or None for zeros
    while it is still loading."""

    def __init__(self, stats: Callable[[], list[tuple[tuple[str, ...], Any | None]]],
                 labels: tuple[str, ...] = ()) -> None:
        self.stats = stats
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        samples = self.stats()
        for name, family, help_text, value in _ENGINE_SERIES:
            metric = family(f"vivace:{name}", help_text, labels=self.labels)
            for label_values, stats in samples:
                metric.add_metric(label_values, value(stats) if stats is not None else 0)
            yield metric


SERVER_WORK = ("parse", "prompt", "sse_write")


# The engine's timing histograms: family name -> (help, label of its series).
_ENGINE_TIMINGS = {
    "engine_step_seconds": ("Engine step time by phase: schedule, forward, sample, emit (detokenize, "
                            "stop checks), finish (block bookkeeping, proposals), and the whole step.", "phase"),
    "engine_handoff_seconds": ("From the engine thread handing a step's outputs over to the event "
                               "loop running the hand-over.", "stage"),
    "gc_pause_seconds": ("Garbage collection pauses of the process (any thread; they hold the GIL).",
                         "collector"),
}
Snapshot = tuple[list[tuple[float, int]], float]  # DurationHistogram.snapshot()


def timing_snapshots(timings: StepTimings) -> dict[str, dict[str, Snapshot]]:
    """The engine's timing histograms as plain data, by family and label value (a replica sends
    them to the ingress of a cluster)."""
    return {"engine_step_seconds": {phase: h.snapshot() for phase, h in timings.steps.histograms.items()},
            "engine_handoff_seconds": {"lag": timings.handoffs.histograms["lag"].snapshot()},
            "gc_pause_seconds": {"python": timings.gc.histograms["pause"].snapshot()}}


def _histogram_family(name: str, doc: str, labels: list[str],
                      series: list[tuple[tuple[str, ...], Snapshot]]) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for label_values, (buckets, total) in series:
        family.add_metric(list(label_values), [("+Inf" if b == float("inf") else str(b), c) for b, c in buckets],
                          total)
    return family


def engine_timing_families(engines: list[tuple[tuple[str, ...], dict[str, dict[str, Snapshot]]]],
                           labels: tuple[str, ...] = ()) -> Iterator[Metric]:
    """The timing histograms of ``engines``: per engine, its label values (as many as ``labels``
    names; none for a lone engine) and its :func:`timing_snapshots`."""
    for name, (doc, label) in _ENGINE_TIMINGS.items():
        yield _histogram_family(f"vivace:{name}", doc, [*labels, label],
                                [((*values, key), snapshot) for values, snapshots in engines
                                 for key, snapshot in snapshots.get(name, {}).items()])


class _TimingCollector(Collector):
    """Histograms of the engine's step timings (once it is loaded) and of the server's work."""

    def __init__(self, timings: Callable[[], StepTimings | None], work: dict[str, TimingLog]) -> None:
        self.timings = timings
        self.work = work

    def collect(self) -> Iterator[Metric]:
        yield _histogram_family("vivace:server_work_seconds", "Server work per request or frame: "
                                "'parse' (body to schema), 'prompt' (chat template and tokenization), "
                                "'sse_write' (one event frame sent).", ["work"],
                                [((kind,), log.histograms["seconds"].snapshot()) for kind, log in self.work.items()])
        timings = self.timings()
        if timings is not None:
            yield from engine_timing_families([((), timing_snapshots(timings))])


class ServerMetrics:
    """The metrics of one app; ``engine`` yields the engine series at scrape time (an
    :class:`EngineStatsCollector` for one engine), ``timings`` gives the engine's StepTimings or
    None. ``work`` holds the server's own timing logs, by SERVER_WORK kind. ``listeners`` are also
    handed every ended request (the tracer is one)."""

    def __init__(self, engine: Collector, timings: Callable[[], StepTimings | None] = lambda: None) -> None:
        self.listeners: list[Callable[[EngineRequest], None]] = []
        self.registry = CollectorRegistry()
        registry = self.registry
        self.work = {kind: work_log() for kind in SERVER_WORK}

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
        registry.register(engine)
        registry.register(_TimingCollector(timings, self.work))

    def record_rejection(self, reason: str) -> None:
        """Counts one request refused at admission for ``reason``."""
        self.rejected.labels(reason=reason).inc()

    def record_timeout(self, kind: str) -> None:
        """Counts one request ended by its ``kind`` of deadline: "queue" or "request"."""
        self.timed_out.labels(kind=kind).inc()

    def record_output(self, out: RequestOutput, first: bool) -> None:
        """Counts one engine output's new tokens as it streams, and its prompt's with a request's
        ``first``: as vLLM's, the token counters move every step, not when a request ends."""
        if first:
            self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(sum(len(delta.token_ids) for delta in out.outputs))

    def record_request(self, request: EngineRequest) -> None:
        """Records one ended request (finished or aborted)."""
        for listener in self.listeners:
            listener(request)
        for choice in request.choices:
            self.request_success.labels(finished_reason=choice.finish_reason or "abort").inc()
        out = request.last
        if out is None:
            return
        t = out.timings
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
        steps = list(dict.fromkeys(t.token_times))  # a speculative step's tokens share its instant
        for earlier, later in zip(steps, steps[1:]):
            self.itl.observe(later - earlier)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
            self.queue.observe(t.queue_time)
            self.prefill.observe(t.prefill_time)
            self.decode.observe(t.decode_time)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
