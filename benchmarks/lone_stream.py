"""How steady one stream's tokens arrive, served end to end, and where each late one lost its time.

A voice agent reads a stream token by token: a token sent one step late, then together with the
next, is a stutter even when the median ITL is good. Per server and repetition, in turn:

1. start ``vivace serve`` (default model, ``--num-threads``) from this checkout, from each
   ``--baseline DIR`` (a checkout of the code before a change) and again with each ``--also-with
   FLAGS``; with ``--busy N``, N processes spin on the CPU beside it while it is measured;
2. stream ``--requests`` greedy chat answers of ``--max-tokens`` tokens, ``--streams`` at a time
   (default one: a lone stream), timing each content chunk's arrival;
3. read ``/debug/timings`` (same monotonic clock) and split every token's trip after its step
   into the server's part (the hand-off to the event loop until its SSE frame is written) and
   the client's (the frame written until this process reads it); with several streams each
   token is matched to the last frame written before it arrived, whichever stream's.

Prints per server the medians over repetitions: ITL p50 / p99 / mean, p99 / p50, the share of
gaps outside 0.5-1.5 x the median (stutters: a late token, then a bunched one), gaps under 1 ms,
the p99 of each part of the trip, and output tokens a second. The client shares the machine with the server, as in
``peers.py``; its part is what this machine's scheduler adds to the reading.

    python benchmarks/lone_stream.py --baseline ../before --reps 3 --requests 12
    python benchmarks/lone_stream.py --also-with --no-adaptive-threads --busy 1
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from stalls import percentile, start_server, stream

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Story {}:"


def trips(arrivals: list[list[float]], timings: dict) -> tuple[list[float], list[float]]:
    """Per token after a stream's first: seconds from its step's hand-off to its frame's write
    (server), and from the write's end to its arrival here (client)."""
    handoffs = sorted(h["start"] for h in timings["handoffs"])
    writes = sorted((w["start"], w["seconds"]) for w in timings["sse_write"])
    write_starts = [w[0] for w in writes]
    server, client = [], []
    for times in arrivals:
        for arrival in times[1:]:
            write = writes[bisect.bisect_right(write_starts, arrival) - 1]
            handoff = handoffs[bisect.bisect_right(handoffs, write[0]) - 1]
            server.append(write[0] - handoff)
            client.append(max(arrival - write[0] - write[1], 0.0))
    return server, client


async def measure(url: str, args: argparse.Namespace, rep: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout)) as client:
        await stream(client, url, PROMPT.format("warm-up"), 16, [])
        start = (await client.get(url + "/debug/timings", params={"since": 1e12})).json()["now"]
        arrivals: list[list[float]] = []

        async def one_stream(index: int) -> None:
            for i in range(index, args.requests, args.streams):
                arrivals.append([])
                await stream(client, url, PROMPT.format(f"{rep}-{i}"), args.max_tokens, arrivals[-1])

        began = time.perf_counter()
        await asyncio.gather(*(one_stream(index) for index in range(args.streams)))
        elapsed = time.perf_counter() - began
        timings = (await client.get(url + "/debug/timings", params={"since": start})).json()
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    median = statistics.median(gaps)
    server, client_part = trips(arrivals, timings)
    return {"p50": median * 1e3, "p99": percentile(gaps, 99) * 1e3, "mean": statistics.mean(gaps) * 1e3,
            "p99/p50": percentile(gaps, 99) / median,
            "stutters": sum(not 0.5 * median <= g <= 1.5 * median for g in gaps) / len(gaps),
            "bunched": sum(g < 1e-3 for g in gaps) / len(gaps),
            "server p99": percentile(server, 99) * 1e3, "client p99": percentile(client_part, 99) * 1e3,
            "tok/s": sum(map(len, arrivals)) / elapsed, "gaps": len(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, nargs="*", default=[],
                        help="checkouts of other code (before a change), served too, each named by its folder")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--also-with", action="append", default=[], metavar="FLAGS",
                        help="serve this checkout again with these extra flags (repeatable)")
    parser.add_argument("--busy", type=int, default=0,
                        help="processes spinning on the CPU beside the server while it is measured (other work)")
    parser.add_argument("--streams", type=int, default=1, help="streams at once, each sending its share of the requests")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--serve-args", default="", help="more flags for vivace serve")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    args = parser.parse_args()
    servers = {"this checkout": (None, []), **{path.resolve().name: (path.resolve(), []) for path in args.baseline},
               **{f"this checkout {flags}": (None, flags.split()) for flags in args.also_with}}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    for rep in range(args.reps):
        for name, (checkout, flags) in servers.items():
            server, url = start_server("".join(c if c.isalnum() else "-" for c in name), args, flags, checkout)
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
            try:
                figures = asyncio.run(measure(url, args, rep))
            finally:
                for process in busy:
                    process.kill()
                    process.wait()
                server.stop()
            runs[name].append(figures)
            print(f"  rep {rep} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()),
                  file=sys.stderr, flush=True)
    keys = [k for k in next(iter(runs.values()))[0] if k != "gaps"]
    print(f"\n{args.requests} requests of {args.max_tokens} tokens a repetition, {args.streams} at a time, medians over {args.reps} "
          f"repetitions (ms; stutters: share of gaps outside 0.5-1.5 x the median; bunched: under 1 ms)\n")
    print("| server | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for name, reps in runs.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(r[k] for r in reps):.3g}" for k in keys) + " |")


if __name__ == "__main__":
    main()
