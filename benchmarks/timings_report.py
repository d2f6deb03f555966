"""What a server's steps and request work cost, from ``GET /debug/timings`` saved as JSON (the
served stage of ``benchmarks/gpu_device.sh`` saves one per run, ``served-N-timings.json``).

Per file: the engine's steps by kind (decode only, or with prompt tokens) and path: how many,
their phases (schedule, forward, sample, emit, finish) and tokens; the time between one step's
end and the next one's start (the engine thread's work outside steps: taking requests in,
delivering outputs); and every other kind of event (hand-offs to the event loop, GC pauses,
parsing, templating and tokenization, SSE writes) with its durations.

    python benchmarks/timings_report.py OUT/served-64-timings.json [...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

PHASES = ("total", "schedule", "forward", "sample", "emit", "finish")


def quantiles(values: list[float]) -> str:
    """``median / p90 / max`` of seconds, in ms."""
    if not values:
        return "-"
    ordered = sorted(values)
    p90 = ordered[min(int(0.9 * len(ordered)), len(ordered) - 1)]
    return f"{statistics.median(ordered) * 1e3:.2f} / {p90 * 1e3:.2f} / {ordered[-1] * 1e3:.2f}"


def step_report(steps: list[dict]) -> list[str]:
    lines = ["| steps | count | " + " | ".join(f"{p} ms (median / p90 / max)" for p in PHASES)
             + " | decode tokens (median) | prompt tokens (median, sum) |",
             "|---|---|" + "---|" * len(PHASES) + "---|---|"]
    groups: dict[str, list[dict]] = defaultdict(list)
    for step in steps:
        groups[f"{'with prompt' if step.get('prompt_tokens') else 'decode only'}, {step.get('path', '?')}"].append(step)
    for name, group in sorted(groups.items()):
        prompt = [s.get("prompt_tokens", 0) for s in group]
        lines.append(f"| {name} | {len(group)} | " + " | ".join(quantiles([s[p] for s in group if p in s]) for p in PHASES)
                     + f" | {statistics.median(s.get('decode_tokens', 0) for s in group):.0f}"
                     + f" | {statistics.median(prompt):.0f}, {sum(prompt)} |")
    ordered = sorted(steps, key=lambda s: s["start"])
    between = [b["start"] - (a["start"] + a["total"]) for a, b in zip(ordered, ordered[1:])]
    if ordered:
        span = ordered[-1]["start"] + ordered[-1]["total"] - ordered[0]["start"]
        busy = sum(s["total"] for s in ordered)
        lines.append("")
        lines.append(f"{len(ordered)} steps in {span:.2f} s ({len(ordered) / max(span, 1e-9):.0f} a second), in steps "
                     f"{busy / max(span, 1e-9):.0%} of it; between steps (ms, median / p90 / max): "
                     f"{quantiles([max(g, 0.0) for g in between])}, {sum(max(g, 0.0) for g in between):.2f} s in all")
    return lines


def event_report(kind: str, events: list[dict]) -> str:
    fields = [k for k, v in events[0].items() if k != "start" and isinstance(v, float)]
    return f"- {kind}: {len(events)} events; " + "; ".join(
        f"{field} ms (median / p90 / max) {quantiles([e[field] for e in events if field in e])}" for field in fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    for path in parser.parse_args().files:
        body = json.loads(path.read_text())
        print(f"## {path.name}\n")
        print("\n".join(step_report(body.get("steps", []))))
        print()
        for kind, events in body.items():
            if kind not in ("now", "steps") and isinstance(events, list) and events:
                print(event_report(kind, events))
        print()


if __name__ == "__main__":
    main()
