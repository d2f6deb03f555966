"""Streams decoding while long prompts arrive, served end to end, with each big gap traced to its
cause. For every scheduling setting (the pacer, fixed chunks) and repetition, in turn:

1. start ``vivace serve`` (default model, ``--num-threads``) with the setting's flags, on loopback;
2. measure the idle TTFT of a fresh prompt of each length (the prefix cache never helps: every
   prompt is new words);
3. per (streams, prompt length): open the streams (chat, long answers), wait until all decode,
   then send prompts one after another, each ``--interval`` s after the previous one's first
   token, for ``--duration`` s; then close the streams;
4. read the server's ``/debug/timings`` (engine steps, GC pauses, hand-offs to the event loop,
   template and tokenization, on the same monotonic clock as this client) and give every
   stream gap above ``--big-gap`` x the median a cause.

Settings alternate within each repetition, so a neighbour's load hits them alike; compare them
by the medians over repetitions and the per-repetition ratios. Prints markdown tables.

    python benchmarks/stalls.py --settings pacer,chunk16 --reps 3 --streams 8 --prompt-lens 1024

With ``--adversaries`` it measures single requests that the schema accepts but whose handling
could cost the engine thread or the event loop more than their share instead: one greedy stream
decodes throughout; for each named request (ADVERSARIES) its ITL is taken for ``--duration`` s
alone, then for as long while that request is sent again and again. ``--baseline DIR`` serves a
checkout of the code before a change from DIR too, alternating with this one in every repetition:

    python benchmarks/stalls.py --adversaries plain,stop-strings --baseline ../before --reps 3 --duration 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from peers import REPO, Running, Server, free_port

from vivace.bench.client import chunk_content

WORDS = ("harbor light stone river ember cloud maple orbit quiet lantern meadow copper violet "
         "thunder willow glacier falcon prism velvet canyon").split()
SETTINGS = {"pacer": [], "chunk16": ["--max-prefill-chunk", "16"], "chunk64": ["--max-prefill-chunk", "64"],
            "kvf32": ["--kv-cache-dtype", "float32"]}

LETTERS = "abcdefghijklmnopqrstuvwxyz "


def _letters(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(count))


def _chat(rng: random.Random, **fields: object) -> tuple[str, dict]:
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 200,
            "ignore_eos": True, "temperature": 0}
    return "/v1/chat/completions", {**body, **fields}


WEATHER_LIKE = {"type": "object", "properties": {"city": {"type": "string"}}}
# name -> (path, body): requests that use a field at the size the schema allows (a 4 MB body, the
# default --max-request-bytes, bounds them); "plain" is the share of the batch any request takes.
ADVERSARIES: dict[str, Callable[[random.Random], tuple[str, dict]]] = {
    "plain": lambda rng: _chat(rng),
    "stop-strings": lambda rng: _chat(rng, stop=[_letters(rng, 1000) for _ in range(1000)]),
    "stop-strings-n8": lambda rng: _chat(rng, n=8, stop=[_letters(rng, 200) for _ in range(1000)]),
    "stop-token-ids": lambda rng: _chat(rng, min_tokens=200, stop_token_ids=[rng.randrange(49152) for _ in range(400_000)]),
    "messages": lambda rng: ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 20_000,
                                                      "max_tokens": 1}),
    "tools": lambda rng: _chat(rng, max_tokens=1, tools=[{"type": "function", "function": {
        "name": f"tool_{i}", "description": _letters(rng, 100), "parameters": WEATHER_LIKE}} for i in range(1000)]),
    "top-logprobs": lambda rng: _chat(rng, logprobs=True, top_logprobs=20, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}),
    "prompt-logprobs": lambda rng: ("/v1/completions", {"prompt": words(rng, 3000), "prompt_logprobs": 20, "max_tokens": 1}),
    "repetition": lambda rng: ("/v1/completions", {"prompt": words(rng, 3000), "max_tokens": 200, "ignore_eos": True,
                                                   "temperature": 0, "repetition_penalty": 1.1, "frequency_penalty": 0.5}),
    "n128": lambda rng: _chat(rng, n=128, max_tokens=30),
    "prompt-batch": lambda rng: ("/v1/completions", {"prompt": [words(rng, 3) for _ in range(5000)], "max_tokens": 1}),
}


@dataclass
class Scenario:
    streams: int
    prompt_len: int
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (earlier, later) arrival times
    ttfts: list[float] = field(default_factory=list)
    idle_ttft: float = 0.0
    causes: Counter = field(default_factory=Counter)
    preemptions: int = 0

    def itls(self) -> list[float]:
        return [b - a for a, b in self.gaps]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def stream(client: httpx.AsyncClient, url: str, content: str, max_tokens: int,
                 times: list[float]) -> None:
    """Streams one chat completion, appending the arrival time of each content chunk to ``times``."""
    body = {"messages": [{"role": "user", "content": content}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                if chunk_content(json.loads(line[5:])):
                    times.append(time.perf_counter())


async def first_token(client: httpx.AsyncClient, url: str, content: str) -> float:
    """TTFT of one prompt (8 tokens asked for, read to the end)."""
    times: list[float] = []
    sent = time.perf_counter()
    await stream(client, url, content, 8, times)
    return times[0] - sent


async def run_scenario(client: httpx.AsyncClient, url: str, scenario: Scenario, args: argparse.Namespace,
                       rng: random.Random, words_per_token: float) -> tuple[float, float]:
    """Fills ``scenario``; returns the window (start, end) on the perf_counter clock."""
    prompt_words = round(scenario.prompt_len * words_per_token)
    scenario.idle_ttft = statistics.median(
        [await first_token(client, url, words(rng, prompt_words)) for _ in range(2)])
    times: list[list[float]] = [[] for _ in range(scenario.streams)]
    tasks = [asyncio.create_task(stream(client, url, words(rng, 20), 4000, t)) for t in times]
    while not all(times) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.05)
    start = time.perf_counter()
    while time.perf_counter() < start + args.duration:
        scenario.ttfts.append(await first_token(client, url, words(rng, prompt_words)))
        await asyncio.sleep(args.interval)
    end = time.perf_counter()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in times:
        scenario.gaps += [(a, b) for a, b in zip(t, t[1:]) if start <= a and b <= end]
    return start, end


def cause_of(gap: tuple[float, float], timings: dict, decode_step: float) -> str:
    """The main cause of one stream gap, from the server's events inside it."""
    a, b = gap

    def inside(event: dict, length: float) -> bool:
        return event["start"] < b and event["start"] + length > a

    pauses = [e for e in timings["gc"] if inside(e, e["pause"]) and e["pause"] > 0.25 * (b - a)]
    if pauses:
        return f"GC pause (generation {max(e['generation'] for e in pauses)})"
    steps = [e for e in timings["steps"] if inside(e, e["total"])]
    busy = sum(min(e["start"] + e["total"], b) - max(e["start"], a) for e in steps)
    if busy < 0.5 * (b - a):
        if any(inside(e, e["seconds"]) for e in timings["prompt"] + timings["parse"]):
            return "engine idle; server templating/tokenizing"
        return "engine idle between steps (client, HTTP, event loop)"
    slowest = max(steps, key=lambda e: e["total"])
    if slowest["total"] < 1.5 * decode_step:
        return "steps on time; delivery (event loop, HTTP, client)"
    if slowest["decode_tokens"] == 0:
        return "prompt-only step (nothing decoding)"
    if slowest["prompt_tokens"]:
        return "step with a prompt chunk"
    return "slow decode-only step (CPU contention)"


def attribute(scenario: Scenario, timings: dict, big: float) -> None:
    decode_only = [e["total"] for e in timings["steps"] if e["decode_tokens"] and not e["prompt_tokens"]]
    decode_step = statistics.median(decode_only) if decode_only else 0.0
    median = statistics.median(scenario.itls())
    for gap in scenario.gaps:
        if gap[1] - gap[0] > big * median:
            scenario.causes[cause_of(gap, timings, decode_step)] += 1


def start_server(name: str, args: argparse.Namespace, flags: list[str], checkout: Path | None = None
                 ) -> tuple[Running, str]:
    """``vivace serve`` with ``flags``, from this checkout or ``checkout`` (its ``vivace``
    imported first), on a free loopback port; the server and its URL, once it is ready."""
    port = free_port()
    python = [sys.executable] if checkout is None else [sys.executable, "-P"]  # -P: not this checkout first
    command = [*python, "-m", "vivace.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--num-threads", str(args.num_threads), "--log-level", "warning", "--compile-wait", *flags,
               *args.serve_args.split()]
    env = {} if checkout is None else {"PYTHONPATH": str(checkout)}
    server = Running(Server(name, command, "", env, start_timeout_s=args.ready_timeout),
                     REPO / "bench-results" / f"stalls-{name}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_ready(url)
    except BaseException:
        server.stop()
        raise
    return server, url


async def run_setting(setting: str, args: argparse.Namespace, rep: int) -> list[Scenario]:
    server, url = start_server(setting, args, SETTINGS[setting])
    try:
        rng = random.Random(rep * 1000 + 7)
        # Streams are closed at the end of their window; a prompt waits at most this long.
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout)) as client:
            words_per_token = await calibrate(client, url, rng)
            results = []
            for streams in args.streams:
                for prompt_len in args.prompt_lens:
                    scenario = Scenario(streams, prompt_len)
                    preempted = await preemptions(client, url)
                    start, _ = await run_scenario(client, url, scenario, args, rng, words_per_token)
                    scenario.preemptions = await preemptions(client, url) - preempted
                    timings = (await client.get(url + "/debug/timings", params={"since": start - 1})).json()
                    attribute(scenario, timings, args.big_gap)
                    if args.dump:
                        args.dump.mkdir(parents=True, exist_ok=True)
                        path = args.dump / f"{setting}-rep{rep}-{streams}x{prompt_len}.json"
                        path.write_text(json.dumps({"start": start, "gaps": scenario.gaps, "timings": timings}))
                    results.append(scenario)
                    itls = scenario.itls()
                    print(f"  {setting} {streams} streams, {prompt_len}-token prompts: ITL median "
                          f"{statistics.median(itls) * 1e3:.1f} ms, p99 {percentile(itls, 99) * 1e3:.1f} ms; "
                          f"TTFT median {statistics.median(scenario.ttfts) * 1e3:.0f} ms, idle "
                          f"{scenario.idle_ttft * 1e3:.0f} ms; {scenario.preemptions} preemptions",
                          file=sys.stderr, flush=True)
        return results
    finally:
        server.stop()


@dataclass
class Exposure:
    """One adversary in one repetition: the background stream's gaps alone, then beside it."""

    alone: list[float]
    beside: list[float]
    sent: int
    statuses: Counter


async def send(client: httpx.AsyncClient, url: str, path: str, body: dict) -> int:
    """One request, its answer read to the end; its status."""
    async with client.stream("POST", url + path, json=body) as response:
        async for _ in response.aiter_raw():
            pass
        return response.status_code


def gaps_within(streams: list[list[float]], start: float, end: float) -> list[float]:
    return [b - a for times in streams for a, b in zip(times, times[1:]) if start <= a and b <= end]


async def run_adversaries(args: argparse.Namespace, rep: int, checkout: Path | None) -> dict[str, Exposure]:
    """Every adversary in turn beside one greedy stream (restarted whenever it ends)."""
    server, url = start_server("baseline" if checkout else "adversaries", args, SETTINGS["pacer"], checkout)
    rng = random.Random(rep * 1000 + 11)
    streams: list[list[float]] = []

    async def background(client: httpx.AsyncClient) -> None:
        while True:
            streams.append([])
            await stream(client, url, "Count slowly from one to ten thousand.", 4000, streams[-1])

    results = {}
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout)) as client:
            task = asyncio.create_task(background(client))
            while not streams or len(streams[-1]) < 2:
                await asyncio.sleep(0.05)
            for name in args.adversaries:
                path, body = ADVERSARIES[name](rng)
                start = time.perf_counter()
                await asyncio.sleep(args.duration)
                middle, statuses = time.perf_counter(), Counter()
                while not statuses or time.perf_counter() < middle + args.duration:
                    statuses[await send(client, url, path, body)] += 1
                exposure = Exposure(gaps_within(streams, start, middle), gaps_within(streams, middle, time.perf_counter()),
                                    sum(statuses.values()), statuses)
                results[name] = exposure
                print(f"  {'baseline' if checkout else 'this checkout'} {name}: ITL alone median "
                      f"{statistics.median(exposure.alone) * 1e3:.1f} ms, p99 {percentile(exposure.alone, 99) * 1e3:.1f};"
                      f" beside median {statistics.median(exposure.beside) * 1e3:.1f} ms, p99 "
                      f"{percentile(exposure.beside, 99) * 1e3:.1f}, max {max(exposure.beside) * 1e3:.0f}; "
                      f"{exposure.sent} sent {dict(statuses)}", file=sys.stderr, flush=True)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return results
    finally:
        server.stop()


def report_adversaries(runs: dict[str, list[dict[str, Exposure]]], args: argparse.Namespace) -> None:
    print(f"\n## The background stream's ITL beside each request ({args.reps} repetitions, medians over them)\n")
    print("| request | code | ITL alone: median (ms) | p99 (ms) | beside it: median (ms) | p99 (ms) | max (ms) | "
          "sent per window | statuses |\n|---|---|---|---|---|---|---|---|---|")
    for name in args.adversaries:
        for code, reps in runs.items():
            rows = [rep[name] for rep in reps]

            def med(figure: Callable[[Exposure], float]) -> float:
                return statistics.median(figure(e) for e in rows)
            statuses = sum((e.statuses for e in rows), Counter())
            print(f"| {name} | {code} | {med(lambda e: statistics.median(e.alone) * 1e3):.1f} | "
                  f"{med(lambda e: percentile(e.alone, 99) * 1e3):.1f} | {med(lambda e: statistics.median(e.beside) * 1e3):.1f} | "
                  f"{med(lambda e: percentile(e.beside, 99) * 1e3):.1f} | {med(lambda e: max(e.beside) * 1e3):.0f} | "
                  f"{med(lambda e: e.sent):.0f} | {', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))} |")


async def preemptions(client: httpx.AsyncClient, url: str) -> int:
    """The server's preemption count so far (requests whose KV blocks were taken back)."""
    text = (await client.get(url + "/metrics")).text
    return int(next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("vivace:num_preemptions_total")))


async def calibrate(client: httpx.AsyncClient, url: str, rng: random.Random) -> float:
    """Words per prompt token of the chat prompts built here (from the server's usage count)."""
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": words(rng, 400)}]}
    usage = (await client.post(url + "/v1/chat/completions", json=body)).json()["usage"]
    return 400 / usage["prompt_tokens"]


def report(runs: dict[str, list[list[Scenario]]], args: argparse.Namespace) -> None:
    print(f"\n## {args.reps} repetitions, settings alternating; medians over repetitions\n")
    print("| streams | prompt tokens | setting | median ITL (ms) | p99 ITL (ms) | p99 / median | "
          "max ITL (ms) | arrivals' median TTFT (ms) | idle TTFT (ms) | TTFT / idle | arrivals | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for index, (streams, prompt_len) in enumerate((s, p) for s in args.streams for p in args.prompt_lens):
        for setting, reps in runs.items():
            rows = [rep[index] for rep in reps]

            def med(figure: Callable[[Scenario], float]) -> float:
                return statistics.median(figure(s) for s in rows)
            itl_med = med(lambda s: statistics.median(s.itls()) * 1e3)
            p99 = med(lambda s: percentile(s.itls(), 99) * 1e3)
            ttft = med(lambda s: statistics.median(s.ttfts) * 1e3)
            idle = med(lambda s: s.idle_ttft * 1e3)
            print(f"| {streams} | {prompt_len} | {setting} | {itl_med:.1f} | {p99:.1f} | "
                  f"{med(lambda s: percentile(s.itls(), 99) / statistics.median(s.itls())):.2f} | "
                  f"{med(lambda s: max(s.itls()) * 1e3):.0f} | {ttft:.0f} | {idle:.0f} | {ttft / idle:.2f} | "
                  f"{sum(len(s.ttfts) for s in rows)} | {sum(s.preemptions for s in rows)} |")
    print(f"\n## Causes of stream gaps above {args.big_gap:g} x the median ITL (all repetitions)\n")
    print("| streams | prompt tokens | setting | big gaps / all gaps | causes |\n|---|---|---|---|---|")
    for index, (streams, prompt_len) in enumerate((s, p) for s in args.streams for p in args.prompt_lens):
        for setting, reps in runs.items():
            causes = sum((rep[index].causes for rep in reps), Counter())
            total = sum(len(rep[index].gaps) for rep in reps)
            text = "; ".join(f"{name}: {count}" for name, count in causes.most_common())
            print(f"| {streams} | {prompt_len} | {setting} | {sum(causes.values())} / {total} | {text or '-'} |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser.add_argument("--settings", type=lambda s: s.split(","), default=["pacer", "chunk16"],
                        help=f"scheduling settings to compare, of {sorted(SETTINGS)}")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=ints, default=[8])
    parser.add_argument("--prompt-lens", type=ints, default=[1024])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds from a prompt's first token to the next prompt")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds measured per scenario")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--serve-args", default="", help="extra flags for `vivace serve` in every setting, one string")
    parser.add_argument("--big-gap", type=float, default=2.0, help="gaps above this many medians get a cause")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--dump", type=Path, help="write each scenario's stream gaps and server timings here (JSON)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds without a byte before a request fails")
    parser.add_argument("--adversaries", type=lambda s: s.split(","),
                        help=f"measure a stream beside each of these requests instead, of {list(ADVERSARIES)}")
    parser.add_argument("--baseline", type=Path, help="with --adversaries: a checkout of the code before, served in turn")
    args = parser.parse_args()
    unknown = set(args.settings) - set(SETTINGS) or set(args.adversaries or ()) - set(ADVERSARIES)
    if unknown:
        parser.error(f"unknown settings or adversaries {sorted(unknown)}")
    return args


def main() -> None:
    args = parse_args()
    (REPO / "bench-results").mkdir(exist_ok=True)
    if args.adversaries:
        checkouts = {"before": args.baseline, "after": None} if args.baseline else {"this": None}
        exposures: dict[str, list[dict[str, Exposure]]] = {code: [] for code in checkouts}
        for rep in range(args.reps):
            for code in checkouts if rep % 2 == 0 else reversed(checkouts):
                print(f"repetition {rep + 1}/{args.reps}: {code}", file=sys.stderr, flush=True)
                exposures[code].append(asyncio.run(run_adversaries(args, rep, checkouts[code])))
        report_adversaries(exposures, args)
        return
    runs: dict[str, list[list[Scenario]]] = {setting: [] for setting in args.settings}
    for rep in range(args.reps):
        for setting in args.settings if rep % 2 == 0 else reversed(args.settings):
            print(f"repetition {rep + 1}/{args.reps}: {setting}", file=sys.stderr, flush=True)
            runs[setting].append(asyncio.run(run_setting(setting, args, rep)))
    report(runs, args)


if __name__ == "__main__":
    main()
