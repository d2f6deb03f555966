"""What a run leaves behind: a text table, a JSON file with the summary and every
request's timings, and PNG plots (CDF of TTFT, CDF of ITL, ITL over time)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from vivace.bench.client import RequestResult
from vivace.bench.stats import Distribution, Summary

_METRICS = (("ttft", "Time to first token"), ("tpot", "Time per output token (excl. 1st)"),
            ("itl", "Inter-token latency"), ("e2e", "End-to-end latency"))


def format_table(summary: Summary, title: str = "vivace bench") -> str:
    """The human-readable report, one figure per line, latencies in milliseconds."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<44}{text:>16}")

    row("Successful requests:", summary.completed)
    row("Failed requests:", summary.failed)
    for kind, count in sorted(summary.errors.items()):
        row(f"  {kind}:", count)
    row("Benchmark duration (s):", summary.duration_s)
    row("Total input tokens:", summary.input_tokens)
    row("Total generated tokens:", summary.output_tokens)
    row("Prompt length mismatches:", summary.prompt_token_mismatches)
    row("Request throughput (req/s):", summary.request_throughput)
    row("Output token throughput (tok/s):", summary.output_throughput)
    row("Total token throughput (tok/s):", summary.total_token_throughput)
    if summary.goodput is not None:
        row("Request goodput (req/s):", summary.goodput)
    for key, label in _METRICS:
        dist: Distribution = getattr(summary, key)
        lines.append(f"{' ' + label + ' ':-^60}")
        for stat in ("mean", "median", "std", "p90", "p95", "p99", "max"):
            row(f"{stat.capitalize()} {key.upper()} (ms):", getattr(dist, stat))
    lines.append("=" * 60)
    return "\n".join(lines)


def result_record(result: RequestResult) -> dict[str, Any]:
    """One request's timings for the JSON file (seconds, as measured)."""
    return {
        "sent_at": result.sent_at, "ttft": result.ttft, "e2e": result.e2e, "itl": result.itl,
        "output_tokens": result.output_tokens, "prompt_tokens": result.prompt_tokens,
        "expected_prompt_tokens": result.expected_prompt_tokens,
        "error_kind": result.error_kind, "error": result.error,
    }


def write_json(path: Path, summary: Summary, results: list[RequestResult], meta: dict[str, Any]) -> None:
    """Write {"meta", "summary", "requests"}; NaN becomes null so that any JSON reader
    can load the file."""
    document = {"meta": meta, "summary": dataclasses.asdict(summary),
                "requests": [result_record(result) for result in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(document), indent=1))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def plot_cdfs(series: dict[str, list[float]], path: Path, xlabel: str) -> None:
    """One empirical CDF per label (values in seconds, drawn in ms on a log axis) in one PNG."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for label, values in series.items():
        if values:
            ordered = sorted(value * 1000 for value in values)
            fractions = [(index + 1) / len(ordered) for index in range(len(ordered))]
            axes.step(ordered, fractions, where="post", label=label)
    axes.set_xscale("log")  # latency tails span decades
    axes.set_xlabel(xlabel)
    axes.set_ylabel("fraction of samples")
    axes.grid(alpha=0.3)
    axes.legend()
    _save(figure, path)


def plot_itl_over_time(series: dict[str, list[RequestResult]], path: Path) -> None:
    """Every inter-token gap at the time it ended (seconds since the run began)."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4))
    for label, results in series.items():
        times, gaps = [], []
        for result in results:
            for arrival, gap in zip(result.chunk_times[1:], result.itl):
                times.append(result.sent_at + arrival)
                gaps.append(gap * 1000)
        axes.scatter(times, gaps, s=2, alpha=0.5, label=label)
    axes.set_xlabel("time since start of run (s)")
    axes.set_yscale("log")
    axes.set_ylabel("inter-token latency (ms)")
    axes.grid(alpha=0.3)
    axes.legend(markerscale=5)
    _save(figure, path)


def write_plots(directory: Path, label: str, results: list[RequestResult]) -> list[Path]:
    """The three standard plots of one run; returns the files written."""
    ok = [result for result in results if result.success]
    paths = [directory / f"{label}-ttft-cdf.png", directory / f"{label}-itl-cdf.png",
             directory / f"{label}-itl-time.png"]
    plot_cdfs({label: [r.ttft for r in ok if r.ttft is not None]}, paths[0], "time to first token (ms)")
    plot_cdfs({label: [gap for r in ok for gap in r.itl]}, paths[1], "inter-token latency (ms)")
    plot_itl_over_time({label: ok}, paths[2])
    return paths


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: Path) -> None:
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
