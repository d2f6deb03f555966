"""The CPU decode attention op (``torch.ops.vivace.paged_decode_attention``, whichever build this
CPU gets: AVX-512, the AVX2 one, or PyTorch's reference) at the default model's shape (9 query
heads, 3 KV heads, head_dim 64, float32 cache in 16-token blocks): one layer's call for a batch
of sequences at a context length, each adding its next token.

    python benchmarks/cpu_decode_attention.py [--cases 1x128 1x1024 16x160] [--calls 300] [--threads 2]

Prints the median µs a call (after warm-up calls) and the largest difference from
``reference_decode_attention`` on the same inputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vivace.layers import decode_attention

BLOCK, KV_HEADS, HEAD_DIM, HEADS = 16, 3, 64, 9


def measure(num_seqs: int, context: int, calls: int) -> tuple[float, float]:
    """Median µs a call and the largest difference from the reference."""
    per_seq = -(-(context + 1) // BLOCK)
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(2, num_seqs * per_seq, BLOCK, KV_HEADS, HEAD_DIM, generator=generator)
    q, k, v = (torch.randn(num_seqs, h, HEAD_DIM, generator=generator) for h in (HEADS, KV_HEADS, KV_HEADS))
    tables = torch.arange(num_seqs * per_seq).view(num_seqs, per_seq)
    lens = torch.full((num_seqs,), context + 1)
    slots = tables[:, context // BLOCK] * BLOCK + context % BLOCK
    scale = HEAD_DIM ** -0.5

    def call() -> torch.Tensor:
        return torch.ops.vivace.paged_decode_attention(q, k, v, cache, slots, tables, lens, scale)

    for _ in range(20):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    expected = decode_attention.reference_decode_attention(q, k, v, cache.clone(), slots, tables, lens, scale)
    return statistics.median(times) * 1e6, float((call() - expected).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["1x128", "1x1024", "16x160"],
                        help="SEQSxCONTEXT: sequences in the batch, tokens each already holds")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"backend {decode_attention.BACKEND}, threads {args.threads}")
    for case in args.cases:
        num_seqs, context = (int(part) for part in case.split("x"))
        us, diff = measure(num_seqs, context, args.calls)
        print(f"{num_seqs:3d} sequences x {context:5d} tokens: {us:8.1f} µs a call, max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
