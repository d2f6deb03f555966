"""Greedy answers whatever the batch, and what ``batch_invariant`` costs a lone prompt.

``--check``: six prompts, each alone and then arriving one every three steps at the same compiled
engine (their chunks riding the others' decode steps); prints, per prompt, the first token where
the two greedy answers part (None: identical), with ``batch_invariant`` on and off.

``--ttft N ...``: time to first token of single random prompts of N tokens on a compiled engine
(median of ``--rounds`` prompts, each new so no prefix is cached), ``batch_invariant`` on and off
alternating, round after round, in one process.

    .venv/bin/python benchmarks/batch_invariance.py [--model default|gemma-3-270m] [--check]
        [--ttft 400 1000 2000 4000] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from vivace import LLM, SamplingParams

TOPICS = ["the number seven", "lighthouses", "volcanoes", "tea", "black holes", "bees"]
CHAT = {  # the bundled models' turn markers, so the prompts are what a chat server sends
    "default": "<|im_start|>user\nWrite a short poem about {}.<|im_end|>\n<|im_start|>assistant\n",
    "gemma-3-270m": "<start_of_turn>user\nWrite a short poem about {}.<end_of_turn>\n<start_of_turn>model\n",
}


def first_differences(llm: LLM, prompts: list[str], max_tokens: int) -> list[int | None]:
    """Per prompt, the first token where its answer alone and its answer arriving among the
    others (one every 3 engine steps) part; None where they are the same."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    alone = [llm.generate(prompt, params)[0].outputs[0].token_ids for prompt in prompts]
    engine = llm.engine
    together: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while step < 3 * len(prompts) or engine.has_unfinished():
        if step % 3 == 0 and step // 3 < len(prompts):
            engine.add_request(str(step // 3), prompts[step // 3], params)
        for out in engine.step():
            together[out.request_id] += out.outputs[0].token_ids
        step += 1
    return [next((t for t, (a, b) in enumerate(zip(ours, together[str(i)])) if a != b), None)
            for i, ours in enumerate(alone)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", choices=sorted(CHAT))
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--ttft", type=int, nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=60)
    args = parser.parse_args()
    engines = {flag: LLM(args.model, compile=True, num_threads=args.threads, batch_invariant=flag)
               for flag in (True, False)}
    if args.check:
        prompts = [CHAT[args.model].format(topic) for topic in TOPICS]
        for flag, llm in engines.items():
            print(f"batch_invariant={flag}: first differing token per prompt "
                  f"{first_differences(llm, prompts, args.max_tokens)}", flush=True)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)
    for llm in engines.values():  # warm: the compiled graph and the kernels' first shapes
        llm.generate([rng.randrange(100, 20000) for _ in range(600)], params)
    for length in args.ttft:
        times: dict[bool, list[float]] = {flag: [] for flag in engines}
        for _ in range(args.rounds):
            for flag, llm in engines.items():
                prompt = [rng.randrange(100, 20000) for _ in range(length)]
                start = time.perf_counter()
                llm.generate(prompt, params)
                times[flag].append(time.perf_counter() - start)
        on, off = (statistics.median(times[flag]) * 1e3 for flag in (True, False))
        print(f"{length:6} prompt tokens: TTFT {on:8.1f} ms batch_invariant, {off:8.1f} ms without "
              f"({on / off:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
