"""Batch-1 decode with and without n-gram speculation on input-grounded prompts, one process.

Each prompt asks the default model to repeat or lightly edit a passage it is given, so much of
the answer can be looked up in the prompt. Both engines alternate prompt by prompt; greedy
outputs must be identical (checked), and tokens/s and acceptance are reported.

    .venv/bin/python benchmarks/speculative.py [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import statistics

from vivace import LLM, SamplingParams

PASSAGE = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the "
           "clocks were striking thirteen. All happy families are alike; each unhappy family is "
           "unhappy in its own way.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
TASKS = [
    f"Repeat the following text exactly:\n\n{PASSAGE}",
    f"Rewrite this code with type hints, changing nothing else:\n\n{CODE}",
    f"Copy this passage, then say how many sentences it has:\n\n{PASSAGE}",
    f"Rename the function mul to multiply in this code and output the full code:\n\n{CODE}",
]


def decode_seconds_per_token(llm: LLM, prompt: str, max_tokens: int) -> tuple[float, list[int]]:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    times = out.timings.token_times
    return (times[-1] - times[0]) / max(len(times) - 1, 1), out.outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    plain = LLM("default", kv_cache_memory_gb=0.25)
    spec = LLM("default", kv_cache_memory_gb=0.25, speculative="ngram", num_speculative_tokens=args.k)
    chat = plain.tokenizer.apply_chat_template
    prompts = [chat([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False) for t in TASKS]
    ratios, identical = [], True
    for prompt in prompts:
        base, base_ids = decode_seconds_per_token(plain, prompt, args.max_tokens)
        fast, fast_ids = decode_seconds_per_token(spec, prompt, args.max_tokens)
        identical &= base_ids == fast_ids
        ratios.append(base / fast)
        print(f"{1 / base:6.1f} tok/s plain  {1 / fast:6.1f} tok/s n-gram  speed-up {base / fast:.2f}x "
              f"({len(base_ids)} tokens)")
    stats = spec.engine.spec_stats
    print(f"median speed-up {statistics.median(ratios):.2f}x; greedy outputs identical: {identical}; "
          f"acceptance {stats.acceptance_rate:.2f}, mean tokens per verify step {stats.mean_accepted_length:.2f}")


if __name__ == "__main__":
    main()
