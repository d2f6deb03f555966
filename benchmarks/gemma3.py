"""Gemma 3 270M (Q4_K_M GGUF, the ``gemma-3-270m`` one-word model) in vivace, batch 1.

Per configuration (quantization x dtype): TTFT for 128- and 512-token prompts, median decode
ITL over 32 tokens, and the logits layer alone (262,144 x 640: about a third of the model's
weight bytes) at M = 1. The native int4/int8 kernels need AVX-512 VNNI: where the CPU lacks it
the quantized rows show the PyTorch fallback (a dequantization per call), and say so.
llama.cpp's figures for the same file on 2 threads are in docs/FACTS.md (ITL ~14 ms, TTFT ~740 ms
at 512 tokens).

    .venv/bin/python benchmarks/gemma3.py [--threads 2] [--configs auto:float32 none:float32 none:bfloat16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from vivace import LLM, SamplingParams
from vivace.kernels import quant_linear_kernel


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(300, 200000) for _ in range(length - 1)]


def ttft(llm: LLM, ids: list[int]) -> float:
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    return out.timings.first_token - out.timings.arrival


def itl(llm: LLM, ids: list[int], tokens: int) -> float:
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
    return statistics.median(b - a for a, b in zip(out.timings.token_times, out.timings.token_times[1:]))


@torch.inference_mode()
def logits_layer(llm: LLM, dtype: torch.dtype, repeats: int = 5) -> float:
    model = llm.engine.loaded.model
    hidden = torch.randn(1, model.config.hidden_size).to(dtype)
    model.compute_logits(hidden)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.compute_logits(hidden)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["auto:float32", "none:float32", "none:bfloat16"])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    native = quant_linear_kernel() is not None
    print(f"native quantized kernels: {'yes' if native else 'no (CPU without AVX-512 VNNI): PyTorch fallback'}")
    print("| quantization | dtype | weights MB | TTFT 128 (ms) | TTFT 512 (ms) | ITL p50 (ms) | logits layer (ms) |")
    print("|---|---|---|---|---|---|---|")
    for config in args.configs:
        quantization, dtype = config.split(":")
        llm = LLM("gemma-3-270m", quantization=quantization, dtype=dtype, num_threads=args.threads,
                  num_kv_blocks=96, block_size=16, max_num_batched_tokens=1024)
        ttft(llm, prompt(16, seed=0))  # warm-up
        t128, t512 = ttft(llm, prompt(128, seed=1)), ttft(llm, prompt(512, seed=2))
        gap = itl(llm, prompt(64, seed=3), args.tokens)
        head = logits_layer(llm, llm.engine.config.torch_dtype)
        print(f"| {quantization} | {dtype} | {llm.engine.loaded.weight_bytes / 1e6:.0f} | {t128 * 1e3:.0f} | "
              f"{t512 * 1e3:.0f} | {gap * 1e3:.1f} | {head * 1e3:.1f} |", flush=True)
        del llm


if __name__ == "__main__":
    main()
