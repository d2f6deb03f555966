"""Predicted outputs, served end to end: a code-editing workload with and without ``prediction``.

    .venv/bin/python benchmarks/prediction.py [--rounds 5] [--files 4] [--max-tokens 512]
        [--threads 2] [--model default] [--serve-args "--speculative ngram"]

Starts ``vivace serve`` (``--model``, ``--threads`` torch threads, on 127.0.0.1) and sends
it, one request at a time, "rewrite this file with <small change>" for a few code files of 200 to
400 tokens (benchmarks/data/prediction), at temperature 0: each file once without a prediction
and once with ``prediction`` = the original file, the two in alternating order round by round
(round 0 warms up and is not counted). Streams with ``include_usage``; prints per mode the median
total latency, time per output token after the first (TPOT) and inter-token latency (ITL, every
chunk gap), the prediction's acceptance (accepted / proposed tokens, and accepted / output
tokens), the ratios, whether each answer was the same in both modes (it must be), and the
server's median decode step time by its rows (1: a plain step; k + 1: verifying k proposals;
from ``/debug/timings``, its last 4,096 steps), which is what a longer proposal costs.
The default model (135M parameters) copies a file only in part before it wanders off, so its
acceptance is low; a model that follows the instruction shows what predictions are for. The
answers must be identical in both modes (the script exits 1 when one is not): the server waits for
its compiled decode graph (``--compile-wait``), whose verify steps compute what its one-row steps do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from peers import REPO, Running, Server, free_port

FILES = Path(__file__).resolve().parent / "data" / "prediction"
EDITS = {  # file -> the small change asked for
    "inventory.py.txt": "the method `restock` renamed to `replenish`",
    "retry.py.txt": "the default number of attempts changed from 3 to 5",
    "matrix.js.txt": "`const matrix = []` written as `let matrix = []`",
    "config.py.txt": "the default port changed from 8080 to 9090",
}
MODES = ("plain", "prediction")


@dataclass
class Sample:
    total: float
    ttft: float
    gaps: list[float]
    completion_tokens: int
    accepted: int
    rejected: int
    text: str

    @property
    def tpot(self) -> float:
        return (self.total - self.ttft) / max(self.completion_tokens - 1, 1)


@dataclass
class Mode:
    samples: list[Sample] = field(default_factory=list)

    def median(self, what: str) -> float:
        return statistics.median(getattr(s, what) for s in self.samples)


def ask(client: openai.OpenAI, name: str, max_tokens: int, predict: bool) -> Sample:
    """One streamed request for ``name``'s edit, timed on the client."""
    source = (FILES / name).read_text()
    prompt = (f"Rewrite this file with {EDITS[name]}. Answer with the whole file and nothing else.\n\n"
              f"{source}")
    extra = {"prediction": {"type": "content", "content": source}} if predict else {}
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, **extra)
    arrivals, text, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    total = time.perf_counter() - start
    details = usage.completion_tokens_details
    return Sample(total, arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])],
                  usage.completion_tokens, details.accepted_prediction_tokens if details else 0,
                  details.rejected_prediction_tokens if details else 0, "".join(text))


def run(client: openai.OpenAI, args: argparse.Namespace) -> tuple[dict[str, Mode], list[bool]]:
    modes = {mode: Mode() for mode in MODES}
    same = []
    names = list(EDITS)[:args.files]
    for round_ in range(args.rounds + 1):
        for name in names:
            order = MODES if (round_ + names.index(name)) % 2 == 0 else MODES[::-1]
            got = {mode: ask(client, name, args.max_tokens, mode == "prediction") for mode in order}
            same.append(got["plain"].text == got["prediction"].text)
            if round_ == 0:
                continue
            for mode, sample in got.items():
                modes[mode].samples.append(sample)
            p = got["prediction"]
            print(f"round {round_} {name}: plain {got['plain'].total:.2f} s, prediction {p.total:.2f} s, "
                  f"{p.completion_tokens} tokens, {p.accepted} accepted, {p.rejected} rejected", flush=True)
    return modes, same


def report(modes: dict[str, Mode], same: list[bool]) -> None:
    plain, predicted = modes["plain"], modes["prediction"]
    accepted = sum(s.accepted for s in predicted.samples)
    proposed = accepted + sum(s.rejected for s in predicted.samples)
    output = sum(s.completion_tokens for s in predicted.samples)
    print("\n| mode | median total (s) | median TPOT (ms) | median ITL (ms) | output tokens (median) |")
    print("|---|---|---|---|---|")
    for name, mode in modes.items():
        itl = statistics.median(g for s in mode.samples for g in s.gaps) if any(s.gaps for s in mode.samples) else 0.0
        print(f"| {name} | {mode.median('total'):.3f} | {mode.median('tpot') * 1e3:.2f} | {itl * 1e3:.2f} | "
              f"{mode.median('completion_tokens'):.0f} |")
    print(f"\nplain / prediction: total {plain.median('total') / predicted.median('total'):.2f}x, "
          f"TPOT {plain.median('tpot') / predicted.median('tpot'):.2f}x")
    print(f"acceptance: {accepted} of {proposed} proposed tokens ({accepted / max(proposed, 1):.2f}); "
          f"{accepted / max(output, 1):.2f} of the output tokens came from the prediction")
    print(f"answers identical in both modes: {sum(same)} of {len(same)}")


def step_costs(url: str) -> None:
    """Median wall time of the server's decode-only steps, by their rows."""
    steps = httpx.get(url + "/debug/timings", params={"since": 0}, timeout=30).json()["steps"]
    by_rows: dict[int, list[float]] = {}
    for step in steps:
        if step["decode_tokens"] and not step["prompt_tokens"]:
            by_rows.setdefault(step["decode_tokens"], []).append(step["total"])
    print("\n| decode rows | steps | median step (ms) |\n|---|---|---|")
    for rows, times in sorted(by_rows.items()):
        print(f"| {rows} | {len(times)} | {statistics.median(times) * 1e3:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--files", type=int, default=len(EDITS), help="how many of the files to edit")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="default")
    parser.add_argument("--serve-args", default="", help="extra flags for `vivace serve`, one string")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "vivace.cli", "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
               "--num-threads", str(args.threads), "--served-model-name", "bench", "--log-level", "warning",
               "--compile-wait", *args.serve_args.split()]
    log = REPO / "bench-results" / "prediction-serve.log"
    log.parent.mkdir(exist_ok=True)
    server = Running(Server("vivace", command, "", start_timeout_s=args.ready_timeout), log)
    try:
        url = f"http://127.0.0.1:{port}"
        print(f"vivace serve ready in {server.wait_ready(url):.0f} s: {' '.join(command[1:])}", flush=True)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        modes, same = run(client, args)
        step_costs(url)
    finally:
        server.stop()
    report(modes, same)
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
