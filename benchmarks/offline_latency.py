"""Offline latency of vivace against transformers on the same weights, in one run.

TTFT for 128/512/1024-token prompts and batch-1 decode (ms/token, tokens/s and bandwidth
achieved = weight bytes x tokens/s). The two engines alternate, round after round, so a
noisy neighbour hits both alike; medians are reported.

    .venv/bin/python benchmarks/offline_latency.py [--dtype float32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import transformers

from vivace import LLM, SamplingParams
from vivace.models.loader import default_model_path

PROMPT_LENGTHS = (128, 512, 1024)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(length)]


def vivace_ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    return out.timings.first_token - out.timings.arrival


def vivace_itl(llm: LLM, prompt: list[int], tokens: int) -> float:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
    gaps = [b - a for a, b in zip(out.timings.token_times, out.timings.token_times[1:])]
    return statistics.median(gaps)


@torch.inference_mode()
def hf_ttft(model: transformers.PreTrainedModel, prompt: list[int]) -> float:
    start = time.perf_counter()
    model.generate(torch.tensor([prompt]), max_new_tokens=1, min_new_tokens=1, do_sample=False)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_itl(model: transformers.PreTrainedModel, prompt: list[int], tokens: int) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return (time.perf_counter() - start - first) / (tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(2)
    llm = LLM("default", dtype=args.dtype, quantization="none", kv_cache_memory_gb=0.25)
    weight_bytes = llm.engine.loaded.weight_bytes
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    results: dict[str, dict[str, list[float]]] = {"vivace": {}, "transformers": {}}
    for round_index in range(args.rounds):
        for length in PROMPT_LENGTHS:
            prompt = random_prompt(length, seed=round_index * 1000 + length)  # fresh: no prefix-cache hit
            results["vivace"].setdefault(f"ttft_{length}", []).append(vivace_ttft(llm, prompt))
            results["transformers"].setdefault(f"ttft_{length}", []).append(hf_ttft(hf, prompt))
        prompt = random_prompt(128, seed=round_index)
        results["vivace"].setdefault("itl", []).append(vivace_itl(llm, prompt, args.decode_tokens))
        results["transformers"].setdefault("itl", []).append(hf_itl(hf, prompt, args.decode_tokens))
    print(f"SmolLM2-135M-Instruct ({path.name}) dequantized to {args.dtype}; weights {weight_bytes / 1e6:.0f} MB; "
          f"{args.rounds} rounds, medians; torch threads {torch.get_num_threads()}")
    print("| figure | vivace | transformers | vivace / transformers |")
    print("|---|---|---|---|")
    for key in [f"ttft_{n}" for n in PROMPT_LENGTHS] + ["itl"]:
        ours = statistics.median(results["vivace"][key]) * 1000
        theirs = statistics.median(results["transformers"][key]) * 1000
        label = f"TTFT, {key[5:]}-token prompt (ms)" if key != "itl" else "batch-1 decode (ms/token)"
        print(f"| {label} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")
    for name in ("vivace", "transformers"):
        itl = statistics.median(results[name]["itl"])
        print(f"{name}: {1 / itl:.1f} tokens/s, bandwidth achieved {weight_bytes / itl / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
