"""What the per-request fault guards cost per engine step: the finite check over the logits
rows, the saturation of penalized logits, and the whole greedy sampler call beside them, at the
default model's vocabulary (49,152) for 1 and 16 rows. Prints medians in microseconds.

    python benchmarks/sampler_guards.py
"""

from __future__ import annotations

import statistics
import time

import torch

from vivace.engine.request import Request
from vivace.engine.sampler import Sampler, saturate
from vivace.engine.sampling_params import SamplingParams

VOCAB = 49152


def median_us(fn, repeats: int = 2000) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    sampler = Sampler(eos_token_ids=(0,))
    print("| rows | finite check µs | saturate µs | greedy sampler call µs |")
    print("|---|---|---|---|")
    for rows in (1, 16):
        logits = torch.randn(rows, VOCAB)
        requests = [Request(str(i), [1, 2, 3], SamplingParams(temperature=0)) for i in range(rows)]
        check = median_us(lambda: torch.isfinite(logits.sum(-1)).tolist())
        clamp = median_us(lambda: saturate(logits.clone()))
        call = median_us(lambda: sampler(logits, requests))
        print(f"| {rows} | {check:.1f} | {clamp:.1f} | {call:.1f} |")


if __name__ == "__main__":
    main()
