"""Command line of `vivace bench` (also `python -m vivace.bench`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

from vivace.bench.load import LoadPlan
from vivace.bench.report import format_table, write_json, write_plots
from vivace.bench.runner import BenchConfig, BenchError, run_benchmark
from vivace.bench.stats import parse_slo


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Add every `vivace bench` option to `parser`."""
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    target.add_argument("--api", choices=("completions", "chat"), default="completions")
    target.add_argument("--model", help="model name to send (default: the server's first in /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    target.add_argument("--output-control", choices=("auto", "ignore_eos", "min_tokens", "none"), default="auto",
                        help="how the output length is pinned; auto probes the server")
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn", "jsonl"), default="random")
    work.add_argument("--input-len", type=int, default=128, help="prompt tokens (per turn for multi-turn)")
    work.add_argument("--output-len", type=int, default=128, help="tokens to generate per request")
    work.add_argument("--prefix-len", type=int, default=64, help="shared-prefix: tokens every prompt shares")
    work.add_argument("--turns", type=int, default=3, help="multi-turn: user turns per conversation")
    work.add_argument("--dataset", help="jsonl: file of {\"prompt\": ...} or {\"turns\": [...]} lines")
    work.add_argument("--tokenizer", help="HF directory or GGUF file of the served model, for exact prompt lengths")
    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=50, help="measured requests (warm-up excluded)")
    load.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted")
    load.add_argument("--concurrency", type=int, default=1, help="requests in flight at most (0: no cap)")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: inf)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    load.add_argument("--max-duration", type=float, default=600.0, help="seconds after which no request starts")
    load.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    load.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("output")
    out.add_argument("--slo", default="ttft=200ms,tpot=50ms", help="goodput bounds, e.g. ttft=200ms,tpot=50ms")
    out.add_argument("--output-json", type=Path, help="write summary and per-request timings here")
    out.add_argument("--plots-dir", type=Path, help="write TTFT/ITL CDF and ITL-over-time PNGs here")
    out.add_argument("--label", default="vivace-bench", help="name used in the table title and plot files")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A BenchConfig from parsed arguments. Raises ValueError on a bad --slo or a
    non-positive count."""
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-requests, --input-len and --output-len must be positive")
    plan = LoadPlan(concurrency=args.concurrency or None, request_rate=args.request_rate,
                    burstiness=args.burstiness, max_requests=args.num_requests,
                    max_duration_s=args.max_duration, seed=args.seed)
    return BenchConfig(
        base_url=args.base_url, api=args.api, model=args.model, api_key=args.api_key,
        workload=args.workload, input_len=args.input_len, output_len=args.output_len,
        prefix_len=args.prefix_len if args.workload == "shared-prefix" else 0, turns=args.turns,
        dataset=args.dataset, tokenizer=args.tokenizer, num_requests=args.num_requests, warmup=args.warmup,
        plan=plan, request_timeout_s=args.request_timeout, slo=parse_slo(args.slo) if args.slo else None,
        output_control=args.output_control, temperature=args.temperature, extra_body=args.extra_body,
        progress=not args.no_progress,
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the arguments describe, print the table, write the files.
    Returns 0 when every measured request succeeded, 1 when some failed, 2 when the
    benchmark could not run."""
    try:
        config = config_from_args(args)
        outcome = asyncio.run(run_benchmark(config))
    except (BenchError, ValueError) as exc:
        print(f"vivace bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(outcome.summary, args.label))
    if args.output_json:
        write_json(args.output_json, outcome.summary, outcome.results, outcome.meta)
    if args.plots_dir:
        write_plots(args.plots_dir, args.label, outcome.results)
    return 1 if outcome.summary.failed else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m vivace.bench`."""
    parser = argparse.ArgumentParser(prog="vivace bench", description=__doc__)
    add_bench_args(parser)
    return run_bench(parser.parse_args(argv))
