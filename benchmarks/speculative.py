"""Batch-1 decode with and without n-gram speculation on input-grounded prompts, one process.

Each prompt asks the default model to repeat or lightly edit a passage it is given, so much of
the answer can be looked up in the prompt. Two engines in the served fast configuration
(compiled decode, int8 linears, unless flags say otherwise), one plain and one with n-gram
speculation, alternate prompt by prompt for ``--rounds`` rounds; greedy outputs must be
identical (checked). Reported per prompt: decode tokens/s (first token to last), the speed-up
(median over rounds), acceptance and tokens per verify step; a free-writing control prompt is
reported outside the median.

Time is the engine's: the sum of its step durations. With ``--clock cpu`` (the default; one
torch thread) a step lasts the thread's CPU time, so neighbours' load on a shared machine
does not count; ``--clock wall`` uses wall time and ``--threads`` torch threads.

    .venv/bin/python benchmarks/speculative.py [--max-tokens 96] [--k 4] [--rounds 3]
        [--dtype float32] [--quantization int8] [--no-compile] [--clock cpu|wall] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

from vivace.config import EngineConfig
from vivace.engine.llm_engine import LLMEngine
from vivace.engine.sampling_params import SamplingParams
from vivace.engine.speculative import SpecStats

PASSAGE = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the "
           "clocks were striking thirteen. All happy families are alike; each unhappy family is "
           "unhappy in its own way.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
TASKS = {
    "repeat a passage": f"Repeat the following text exactly:\n\n{PASSAGE}",
    "add type hints to code": f"Rewrite this code with type hints, changing nothing else:\n\n{CODE}",
    "copy a passage, count sentences": f"Copy this passage, then say how many sentences it has:\n\n{PASSAGE}",
    "rename a function, output the code":
        f"Rename the function mul to multiply in this code and output the full code:\n\n{CODE}",
}
# Free writing, where n-gram proposals rarely land: reported, outside the median, to show what
# speculation costs when it mostly pauses.
CONTROL = {"free writing (control)": "Write a short story about a lighthouse keeper who finds a message in a bottle."}


def decode_rate(engine: LLMEngine, prompt: str, max_tokens: int,
                clock: Callable[[], float]) -> tuple[float, list[int]]:
    """Decode tokens/s of one greedy request alone (first token to last, engine step time) and
    its output token ids."""
    engine.add_request("bench", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    elapsed, first, token_ids = 0.0, None, []
    while engine.has_unfinished():
        start = clock()
        outputs = engine.step()
        elapsed += clock() - start
        for out in outputs:
            token_ids += out.outputs[0].token_ids
            first = elapsed if first is None else first
    return (len(token_ids) - 1) / (elapsed - first), token_ids


def spec_delta(engine: LLMEngine, before: SpecStats) -> SpecStats:
    now = engine.spec_stats
    return SpecStats(now.num_steps - before.num_steps, now.num_proposed - before.num_proposed,
                     now.num_accepted - before.num_accepted)


def compare(plain: LLMEngine, spec: LLMEngine, name: str, task: str, args: argparse.Namespace,
            clock: Callable[[], float]) -> tuple[float, bool]:
    """Alternate the two engines on one chat prompt; print its table row; return the median
    speed-up and whether the greedy outputs were identical every round."""
    prompt = plain.tokenizer.apply_chat_template([{"role": "user", "content": task}], add_generation_prompt=True,
                                                 tokenize=False)
    rates, identical, before = [], True, dataclasses.replace(spec.spec_stats)
    for _ in range(args.rounds):
        base_rate, base_ids = decode_rate(plain, prompt, args.max_tokens, clock)
        fast_rate, fast_ids = decode_rate(spec, prompt, args.max_tokens, clock)
        identical &= base_ids == fast_ids
        rates.append((base_rate, fast_rate))
    ratio = statistics.median(fast / base for base, fast in rates)
    stats = spec_delta(spec, before)
    print(f"| {name} | {statistics.median(b for b, _ in rates):.1f} | {statistics.median(f for _, f in rates):.1f} "
          f"| {ratio:.2f}x | {stats.acceptance_rate:.2f} | {stats.mean_accepted_length:.2f} | {len(base_ids)} |")
    return ratio, identical


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="int8", choices=["none", "int8", "int4"])
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads with --clock wall")
    args = parser.parse_args()
    threads = 1 if args.clock == "cpu" else args.threads
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    base = EngineConfig(dtype=args.dtype, quantization=args.quantization, compile=args.compile,
                        num_threads=threads, kv_cache_memory_gb=0.25, max_num_seqs=8)
    plain = LLMEngine(base)
    spec = LLMEngine(dataclasses.replace(base, speculative="ngram", num_speculative_tokens=args.k), plain.loaded)
    print(f"default model, {args.dtype}, quantization {args.quantization}, compiled decode "
          f"{'on' if args.compile else 'off'}, {args.clock} clock, {threads} torch thread(s), k = {args.k}, "
          f"up to {args.max_tokens} tokens, {args.rounds} rounds")
    print("| task (chat prompt) | plain tok/s | n-gram tok/s | speed-up | acceptance | tokens per verify step | tokens |")
    print("|---|---|---|---|---|---|---|")
    before = dataclasses.replace(spec.spec_stats)
    results = [compare(plain, spec, name, task, args, clock) for name, task in TASKS.items()]
    totals = spec_delta(spec, before)
    results += [compare(plain, spec, name, task, args, clock) for name, task in CONTROL.items()]
    print(f"input-grounded prompts: median speed-up {statistics.median(r for r, _ in results[:len(TASKS)]):.2f}x; "
          f"acceptance {totals.acceptance_rate:.2f}, mean tokens per verify step {totals.mean_accepted_length:.2f} "
          f"({totals.num_steps} verify steps); greedy outputs identical: {all(same for _, same in results)}")
    for engine in (plain, spec):
        engine.check_integrity()


if __name__ == "__main__":
    main()
