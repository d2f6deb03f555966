"""Latency-aware scheduling on the default model, driving the engine directly (no HTTP, so the
figures are the scheduler's and the model's, not the server's):

1. prefix: TTFT of a prompt sharing a cached 1,024-token prefix against the same prompt uncached.
2. interference: 8 streams decoding while long prompts arrive at a fixed interval; the streams'
   inter-token latency (median, p99, p99/median) for each prefill chunk (prompt tokens in a
   step that also decodes; "none" computes each prompt whole), with the arriving prompts'
   TTFT, the price of smaller chunks.
3. multi-turn: interleaved chats through the chat template; per turn, median TTFT and the share
   of the prompt served by the prefix cache.

Time is the engine's: the sum of its step durations. With ``--clock cpu`` (the default; one
torch thread) a step lasts the thread's CPU time, so neighbours' load on a shared machine
does not count; ``--clock wall`` uses wall time and the torch threads asked for.

    .venv/bin/python benchmarks/scheduling.py [--chunks pacer,16,64,none] [--interval 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from vivace.config import EngineConfig
from vivace.engine.llm_engine import LLMEngine
from vivace.engine.outputs import RequestOutput
from vivace.engine.sampling_params import SamplingParams

PACER = -1  # in --chunks: no fixed chunk, the pacer chooses
TOPICS = ["lighthouses", "volcanoes", "the history of tea", "black holes", "bees", "chess openings"]


class StepClock:
    """Engine time: the sum of step durations as ``clock`` measures them. Records when each
    request arrived and when each of its tokens came."""

    def __init__(self, engine: LLMEngine, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.clock = clock
        self.now = 0.0
        self.arrivals: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> str:
        self.engine.add_request(request_id, prompt, params)
        self.arrivals[request_id] = self.now
        self.token_times[request_id] = []
        return request_id

    def step(self) -> list[RequestOutput]:
        start = self.clock()
        outputs = self.engine.step()
        self.now += self.clock() - start
        for out in outputs:
            self.token_times[out.request_id].extend([self.now] * len(out.outputs[0].token_ids))
        return outputs

    def run_until_done(self) -> None:
        while self.engine.has_unfinished():
            self.step()

    def ttft(self, request_id: str) -> float | None:
        times = self.token_times[request_id]
        return times[0] - self.arrivals[request_id] if times else None


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def random_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(length)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def prefix_benchmark(clock: StepClock, prefix_len: int, suffix_len: int, trials: int) -> None:
    rng = random.Random(1)
    cold, warm = [], []
    for trial in range(trials):
        prefix = random_ids(rng, prefix_len)  # fresh each trial: the first request misses
        cold_id = clock.add(f"cold-{trial}", prefix + random_ids(rng, suffix_len), greedy(1))
        clock.run_until_done()
        warm_id = clock.add(f"warm-{trial}", prefix + random_ids(rng, suffix_len), greedy(1))
        clock.run_until_done()
        cold.append(clock.ttft(cold_id))
        warm.append(clock.ttft(warm_id))
    cold_ms, warm_ms = statistics.median(cold) * 1e3, statistics.median(warm) * 1e3
    print(f"\n## Prefix cache: {prefix_len}-token shared prefix + {suffix_len}-token suffix, "
          f"{trials} trials, medians")
    print("| uncached TTFT (ms) | cached-prefix TTFT (ms) | ratio |\n|---|---|---|")
    print(f"| {cold_ms:.1f} | {warm_ms:.1f} | {warm_ms / cold_ms:.3f} |")


def interference_run(clock: StepClock, args: argparse.Namespace) -> tuple[list[float], list[float], int]:
    """ITLs of the decoding streams inside the window, TTFTs of the arrived prompts, and how
    many arrivals were still waiting for a first token when the window closed."""
    rng = random.Random(2)
    streams = [clock.add(f"stream-{i}", random_ids(rng, 32), greedy(4000)) for i in range(args.streams)]
    while any(not clock.token_times[s] for s in streams):
        clock.step()
    start = clock.now
    arrivals: list[str] = []
    while clock.now < start + args.duration:
        if clock.now >= start + len(arrivals) * args.interval:
            arrivals.append(clock.add(f"arrival-{len(arrivals)}", random_ids(rng, args.prompt_len), greedy(8)))
        clock.step()
    for request_id in list(clock.engine.requests):
        clock.engine.abort_request(request_id)
    gaps = [b - a for s in streams for a, b in zip(clock.token_times[s], clock.token_times[s][1:])
            if a >= start]
    served = [t for t in map(clock.ttft, arrivals) if t is not None]
    return gaps, served, len(arrivals) - len(served)


def interference_benchmark(base: EngineConfig, engine: LLMEngine, measure: Callable[[], float],
                           args: argparse.Namespace) -> None:
    print(f"\n## {args.streams} streams decoding while {args.prompt_len}-token prompts arrive every "
          f"{args.interval:g} s ({args.duration:g} s per chunk size; token budget "
          f"{base.max_num_batched_tokens})")
    print("| prefill chunk | median ITL (ms) | p99 ITL (ms) | p99 / median | max ITL (ms) | ITL samples | "
          "arrivals' median TTFT (s) | arrivals unserved at the end |")
    print("|---|---|---|---|---|---|---|---|")
    whole = max(base.max_num_batched_tokens, args.prompt_len + args.streams)
    for chunk in args.chunks:
        if chunk == PACER:
            config = replace(base, max_prefill_chunk=None)
        else:
            config = (replace(base, max_prefill_chunk=chunk) if chunk else
                      replace(base, max_num_batched_tokens=whole, max_prefill_chunk=whole))
        gaps, served, unserved = interference_run(StepClock(LLMEngine(config, engine.loaded), measure), args)
        median, p99 = statistics.median(gaps) * 1e3, percentile(gaps, 99) * 1e3
        arrivals = f"{statistics.median(served):.2f}" if served else "-"
        label = "pacer" if chunk == PACER else chunk or "none (whole prompts)"
        print(f"| {label} | {median:.1f} | {p99:.1f} | {p99 / median:.2f} | "
              f"{max(gaps) * 1e3:.0f} | {len(gaps)} | {arrivals} | {unserved} |", flush=True)


def chat_prompt(engine: LLMEngine, messages: list[dict[str, str]]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def multi_turn_benchmark(clock: StepClock, conversations: int, turns: int, max_tokens: int) -> None:
    """Conversations run side by side; each sends its next turn as soon as its answer is done."""
    engine = clock.engine
    histories: list[list[dict[str, str]]] = [[] for _ in range(conversations)]
    per_turn: list[list[tuple[float, int, int]]] = [[] for _ in range(turns)]
    queries, hits = engine.kv.stats.prefix_queries, engine.kv.stats.prefix_hits

    def ask(chat: int, turn: int) -> None:
        topic = TOPICS[(chat + turn) % len(TOPICS)]
        histories[chat].append({"role": "user", "content": f"Tell me one thing about {topic}."})
        clock.add(f"chat-{chat}-{turn}", chat_prompt(engine, histories[chat]),
                  SamplingParams(temperature=0, max_tokens=max_tokens))

    for chat in range(conversations):
        ask(chat, 0)
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in clock.step():
            answers.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if not out.finished:
                continue
            chat, turn = map(int, out.request_id.split("-")[1:])
            text = engine.tokenizer.decode(answers[out.request_id], skip_special_tokens=True)
            histories[chat].append({"role": "assistant", "content": text})
            per_turn[turn].append((clock.ttft(out.request_id), out.num_cached_tokens, out.prompt_tokens))
            if turn + 1 < turns:
                ask(chat, turn + 1)
    print(f"\n## Multi-turn chat: {conversations} conversations x {turns} turns, answers up to "
          f"{max_tokens} tokens")
    print("| turn | median TTFT (ms) | median prompt tokens | cached / prompt tokens |\n|---|---|---|---|")
    for turn, rows in enumerate(per_turn, 1):
        cached, prompt = sum(r[1] for r in rows), sum(r[2] for r in rows)
        print(f"| {turn} | {statistics.median(r[0] for r in rows) * 1e3:.1f} | "
              f"{statistics.median(r[2] for r in rows):.0f} | {cached / prompt:.2f} |")
    queries, hits = engine.kv.stats.prefix_queries - queries, engine.kv.stats.prefix_hits - hits
    print(f"prefix-cache hit rate over the workload: {hits / queries:.2f} ({hits} of {queries} tokens)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads with --clock wall")
    parser.add_argument("--compile", action="store_true", help="compiled decode graphs (EngineConfig.compile)")
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="short prompt chunks riding compiled steps through the decode kernel "
                             "(EngineConfig.batch_invariant off)")
    parser.add_argument("--sections", default="prefix,interference,multi-turn")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=5)
    named = {"none": 0, "pacer": PACER}
    parser.add_argument("--chunks", type=lambda s: [named[x] if x in named else int(x) for x in s.split(",")],
                        default=[PACER, 16, 64, 0], help="prefill chunks to compare; none: whole prompts; "
                        "pacer: the pacer chooses (vivace.engine.pacer)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between arriving prompts")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured per chunk size")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    threads = 1 if args.clock == "cpu" else args.num_threads
    measure = time.thread_time if args.clock == "cpu" else time.perf_counter
    base = EngineConfig(model=args.model, dtype=args.dtype, num_threads=threads, compile=args.compile,
                        batch_invariant=args.batch_invariant)
    engine = LLMEngine(base)
    print(f"{engine.model_name}, {args.dtype}, default engine config (token budget "
          f"{base.max_num_batched_tokens}, prefill chunk {base.max_prefill_chunk or 'paced'} unless stated); "
          f"{args.clock} clock, {threads} torch thread(s), compiled decode {'on' if args.compile else 'off'}")
    sections = args.sections.split(",")
    if "prefix" in sections:
        prefix_benchmark(StepClock(engine, measure), args.prefix_len, 32, args.trials)
    if "interference" in sections:
        interference_benchmark(base, engine, measure, args)
    if "multi-turn" in sections:
        multi_turn_benchmark(StepClock(engine, measure), args.conversations, args.turns, max_tokens=48)


if __name__ == "__main__":
    main()
