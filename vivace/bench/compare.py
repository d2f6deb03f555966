"""Side-by-side tables of several servers' runs, as Markdown, with the ratio of a
baseline server's figure to every other server's."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vivace.bench.stats import Summary


@dataclass(frozen=True)
class Figure:
    """One number taken from one workload's summary, e.g. the median ITL of 'decode'."""

    workload: str
    label: str
    unit: str
    pick: Callable[[Summary], float]


def ratio(baseline: float | None, other: float | None) -> float | None:
    """baseline / other, or None when either is missing, not finite, or other is 0."""
    if baseline is None or other is None or not math.isfinite(baseline) or not math.isfinite(other) or other == 0:
        return None
    return baseline / other


def side_by_side(figures: list[Figure], runs: Mapping[str, Mapping[str, Summary | Sequence[Summary]]],
                 baseline: str) -> str:
    """A Markdown table: one row per figure, one column per server in `runs` (server ->
    workload -> summary, or the summaries of several runs, whose median figure is shown),
    then one `baseline/server` column per other server. A server or workload that did not
    run shows as a dash."""
    servers = list(runs)
    others = [server for server in servers if server != baseline]
    header = ["workload", "figure", *servers, *(f"{baseline}/{other}" for other in others)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for figure in figures:
        values = {server: _value(runs[server], figure) for server in servers}
        cells = [figure.workload, f"{figure.label} ({figure.unit})"]
        cells += [_format(values[server]) for server in servers]
        cells += [_format(ratio(values.get(baseline), values[other]), suffix="x") for other in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _value(workloads: Mapping[str, Summary | Sequence[Summary]], figure: Figure) -> float | None:
    summaries = workloads.get(figure.workload, [])
    values = [figure.pick(s) for s in ([summaries] if isinstance(summaries, Summary) else summaries)
              if s.completed > 0]
    return statistics.median(values) if values else None


def _format(value: float | None, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "–"
    digits = 2 if abs(value) < 100 else 1 if abs(value) < 1000 else 0
    return f"{value:.{digits}f}{suffix}"
