"""Scale-out on Ray Serve, side by side in one run (each configuration is a fresh
``vivace serve`` process; the load is ``vivace bench`` over HTTP):

1. routing: ``--workload multi-turn`` chats against 2 replicas with ``--routing prefix``,
   ``pow2`` and ``round-robin``, and against the single-process server: prefix-cache hit rate
   (cached / looked-up prompt tokens, from /metrics) and TTFT p50/p99.
2. scale: 16 streams on 1 replica x 2 threads and on 2 replicas x 1 thread: output tok/s,
   TTFT and ITL p50/p99; and at batch 1, the ITL of the single-process server against one
   replica behind the ingress (the Serve hop's cost).
3. chaos: 16 streams on 2 replicas, one replica SIGKILLed 5 s in: requests failed, and
   seconds until /replicas shows its replacement running.

    .venv/bin/python benchmarks/scale_out.py [--sections routing,scale,chaos] [--model default]
        [--serve-args "--kv-cache-memory-gb 0.25"] [--output docs/scale_out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
PORT = 8790
BASE = f"http://127.0.0.1:{PORT}"


@contextlib.contextmanager
def serving(flags: list[str], args: argparse.Namespace) -> Iterator[subprocess.Popen]:
    """``vivace serve`` with ``flags`` until the block ends (SIGTERM, then waited for)."""
    command = [sys.executable, "-m", "vivace.cli", "serve", args.model, "--port", str(PORT),
               "--log-level", "warning", "--compile-wait", *shlex.split(args.serve_args), *flags]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # a group with the Ray processes it starts
    try:
        deadline = time.monotonic() + args.start_timeout
        while not healthy():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(command)} did not start; see {log.name}")
            time.sleep(1)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def healthy() -> bool:
    try:
        return httpx.get(f"{BASE}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def prefix_tokens() -> tuple[float, float]:
    """(prompt tokens looked up, found cached), summed over the server's engines."""
    text = httpx.get(f"{BASE}/metrics", timeout=10).text
    totals = {"vivace:prefix_cache_queries_total": 0.0, "vivace:prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["vivace:prefix_cache_queries_total"], totals["vivace:prefix_cache_hits_total"]


def bench(extra: list[str], label: str) -> dict:
    """One ``vivace bench`` run; its JSON summary."""
    with tempfile.TemporaryDirectory() as out:
        path = Path(out) / "bench.json"
        subprocess.run([sys.executable, "-m", "vivace.bench", "--base-url", BASE, "--no-progress",
                        "--label", label, "--output-json", str(path), *extra], cwd=REPO, check=False)
        return json.loads(path.read_text())["summary"]


def row(label: str, summary: dict, **extra: object) -> dict:
    return {"config": label, "completed": summary["completed"], "failed": summary["failed"],
            "tok_s": round(summary["output_throughput"], 1),
            "ttft_p50": round(summary["ttft"]["median"], 1), "ttft_p99": round(summary["ttft"]["p99"], 1),
            "itl_p50": round(summary["itl"]["median"], 2), "itl_p99": round(summary["itl"]["p99"], 2),
            **extra}


def routing(args: argparse.Namespace) -> list[dict]:
    load = ["--api", "chat", "--workload", "multi-turn", "--turns", "4", "--input-len", "96",
            "--output-len", "32", "--num-requests", str(args.conversations * 4), "--concurrency", "8"]
    rows = []
    for label, flags in (("1 process", []), *((f"2 replicas, {p}", ["--replicas", "2", "--routing", p])
                                              for p in ("prefix", "pow2", "round-robin"))):
        with serving(flags, args):
            queries, hits = prefix_tokens()
            summary = bench(load, label)
            queries2, hits2 = prefix_tokens()
        rows.append(row(label, summary, hit_rate=round((hits2 - hits) / max(queries2 - queries, 1), 3)))
    return rows


def scale(args: argparse.Namespace) -> list[dict]:
    streams = ["--input-len", "128", "--output-len", "64", "--num-requests", "64", "--concurrency", "16"]
    single = ["--input-len", "128", "--output-len", "64", "--num-requests", "16", "--concurrency", "1"]
    rows = []
    for label, flags, load in (
            ("16 streams, 1 replica x 2 threads", ["--replicas", "1", "--num-threads", "2"], streams),
            ("16 streams, 2 replicas x 1 thread", ["--replicas", "2", "--num-threads", "1"], streams),
            ("batch 1, 1 process x 1 thread", ["--num-threads", "1"], single),
            ("batch 1, 1 replica x 1 thread", ["--replicas", "1", "--num-threads", "1"], single)):
        with serving(flags, args):
            rows.append(row(label, bench(load, label)))
    return rows


def chaos(args: argparse.Namespace) -> list[dict]:
    load = ["--input-len", "128", "--output-len", "128", "--num-requests", "96", "--concurrency", "16",
            "--request-timeout", "300"]
    with serving(["--replicas", "2", "--num-threads", "1"], args):
        with tempfile.TemporaryDirectory() as out:
            path = Path(out) / "bench.json"
            runner = subprocess.Popen([sys.executable, "-m", "vivace.bench", "--base-url", BASE,
                                       "--no-progress", "--output-json", str(path), *load], cwd=REPO)
            time.sleep(5)
            replicas = httpx.get(f"{BASE}/replicas", timeout=10).json()["data"]
            victim = replicas[0]
            killed = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            replaced = None
            while replaced is None and time.monotonic() - killed < 300:
                ids = {r["id"] for r in httpx.get(f"{BASE}/replicas", timeout=10).json()["data"]
                       if r["state"] == "RUNNING"}
                if len(ids) == 2 and victim["id"] not in ids:
                    replaced = time.monotonic() - killed
                time.sleep(0.2)
            runner.wait(timeout=600)
            summary = json.loads(path.read_text())["summary"]
    return [row("16 streams, 2 replicas, one SIGKILLed", summary,
                replacement_s=None if replaced is None else round(replaced, 1))]


def markdown(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="routing,scale,chaos")
    parser.add_argument("--model", default="default")
    parser.add_argument("--serve-args", default="", help="extra `vivace serve` flags for every server")
    parser.add_argument("--conversations", type=int, default=12, help="routing: chats of 4 turns")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--output", type=Path, help="also write every row here as JSON")
    args = parser.parse_args()
    results = {}
    for section in args.sections.split(","):
        results[section] = {"routing": routing, "scale": scale, "chaos": chaos}[section](args)
        print(f"\n## {section}\n\n{markdown(results[section])}\n", flush=True)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
