"""Causal prefill attention: the native kernel against the SDPA path it replaced (issue 5).

    python benchmarks/prefill_attention.py [--lengths 128 512 1024 2048] [--rounds 15] [--threads 1]
    python benchmarks/prefill_attention.py --e2e [--prompt 512] [--rounds 3]

Layer mode: one call of ``_prefill_attention`` on SmolLM2-135M's attention shape (9 query heads,
3 KV heads, head_dim 64, float32, 16-token blocks in shuffled order), a fresh prompt of each
length, with the native op and with the SDPA path (gather + ``F.scaled_dot_product_attention``),
interleaved call by call; median CPU time of the calling thread (``time.thread_time``, so time
spent descheduled on a shared machine does not count; one thread only) or wall time otherwise.

End-to-end mode: the prefill step of a fresh ``--prompt``-token prompt with the default model
(int8 linears, no prefix caching), one thread, thread CPU time, with and without the native
kernel, alternating; medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from vivace.layers import attention, prefill_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def clock(threads: int) -> float:
    return time.thread_time() if threads == 1 else time.perf_counter()


def layer(lengths: list[int], rounds: int, threads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"{'L':>6} {'SDPA ms':>9} {'native ms':>10} {'speed-up':>9} {'native GFLOP/s':>15}")
    for length in lengths:
        num_blocks = -(-length // BLOCK_SIZE)
        cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        table = torch.randperm(num_blocks, generator=gen)
        q = torch.randn(length, HEADS, HEAD_DIM, generator=gen).to(dtype)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for native in (False, True):
                prefill_attention.USE_NATIVE = native
                start = clock(threads)
                attention._prefill_attention(q, cache, table, length, HEAD_DIM ** -0.5)
                times[native].append(clock(threads) - start)
        prefill_attention.USE_NATIVE = prefill_attention.BACKEND == "native"
        sdpa, native = (statistics.median(times[k]) * 1e3 for k in (False, True))
        flops = 2 * 2 * HEADS * HEAD_DIM * length * (length + 1) / 2  # QK^T and PV, causal half
        print(f"{length:>6} {sdpa:>9.3f} {native:>10.3f} {sdpa / native:>8.2f}x {flops / native / 1e6:>15.1f}")


def e2e(prompt_len: int, rounds: int) -> None:
    from vivace import LLM, SamplingParams

    llm = LLM("default", quantization="int8", kv_cache_memory_gb=0.25, enable_prefix_caching=False)
    torch.set_num_threads(1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_index in range(rounds + 1):  # the first round warms up
        for native in (False, True):
            prefill_attention.USE_NATIVE = native
            prompt = [rng.randrange(100, 49000) for _ in range(prompt_len)]
            engine.add_request(f"r{round_index}-{native}", prompt, params)
            start = time.thread_time()
            while engine.has_unfinished():
                engine.step()
            if round_index:
                times[native].append(time.thread_time() - start)
    prefill_attention.USE_NATIVE = prefill_attention.BACKEND == "native"
    sdpa, native = (statistics.median(times[k]) * 1e3 for k in (False, True))
    print(f"prefill of a {prompt_len}-token prompt, 1 thread, CPU ms (median of {rounds}): "
          f"SDPA {sdpa:.1f}, native {native:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--e2e", action="store_true", help="time the default model's prefill instead")
    parser.add_argument("--prompt", type=int, default=512)
    args = parser.parse_args()
    print(f"backend: {prefill_attention.BACKEND}")
    if args.e2e:
        e2e(args.prompt, args.rounds or 3)
    else:
        torch.set_num_threads(args.threads)
        layer(args.lengths, args.rounds or 15, args.threads, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
