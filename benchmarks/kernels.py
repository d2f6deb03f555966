"""Weight-only linear kernels against PyTorch's, on SmolLM2-135M's shapes, or (``--gguf``) the GGUF
forms of Gemma 3 270M's Q4_K_M file on its shapes: Q5_0 as 5-bit codes against the same codes
widened to 8 bits (as they ran before the int5 kernel); Q8_0, which is also the 8-bit form Q6_K
ran as before the int6 kernel; Q6_K as 6-bit codes with its two levels of scales; Q4_K and Q5_K
with their two levels against Q4_K's one-level int4 form (float16 scale and min per 32, as it ran
before); IQ4_NL as 4-bit codes looked up in its table against the same widened to 8-bit codes of
its values (as IQ4_NL and IQ4_XS ran before; IQ4_XS's kernel form is IQ4_NL's, a float16 scale
per 32). K-quant and IQ4 blocks are random bytes with modest float16 scales (``gguf`` cannot
quantize to them); the time does not depend on the values.

    python benchmarks/kernels.py [--gguf] [--m 1 16] [--rounds 30] [--threads 2] [--clock wall|cpu]

Every candidate runs interleaved with the others, round after round, over enough copies of
the weight (rotated call by call) that they do not fit in the last-level cache, so the figures
are for weights streamed from memory as in a real decode step. Prints the median µs per call,
the weight GB/s that implies, and each candidate's time relative to fp32 ``F.linear``.
``--clock cpu`` (one thread only) times with the thread's CPU clock, so that time the thread
spends descheduled on a shared machine does not count.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import gguf
import torch
import torch.nn.functional as F

from vivace.layers import quant_format as qf
from vivace.layers.gguf_blocks import from_gguf_blocks
from vivace.layers.linear import QuantizedLinear
from vivace.models.dummy import random_gguf_blocks

T = gguf.GGMLQuantizationType

SHAPES = [(576, 576, "q/o_proj"), (576, 192, "k/v_proj"), (576, 3072, "gate_up"),
          (1536, 576, "down"), (576, 49152, "lm_head")]
GEMMA_SHAPES = [(640, 1536, "qkv"), (640, 4096, "gate_up"), (1024, 640, "o_proj"), (2048, 640, "down"),
                (640, 262144, "lm_head")]
STREAM_BYTES = 64 << 20  # each candidate's rotated copies span this much, twice the 32 MiB L3


Candidate = tuple[Callable[..., torch.Tensor], tuple[object, ...], torch.dtype]


def candidates(k: int, n: int, m: int) -> dict[str, Candidate]:
    """name -> (fn(x, *weights), weights, activation dtype) for one random ``[n, k]`` weight.
    torch's int4 CPU kernel runs only at m == 1: it is some 100x slower than the others at m == 16."""
    w = torch.randn(n, k) * 0.05
    int8 = QuantizedLinear.from_float(w, mode="int8")
    int4 = QuantizedLinear.from_float(w, mode="int4")
    q8, q4 = int8.quantized_rows(), int4.quantized_rows()
    w_i8 = (q8.codes.to(torch.int16) - 128).to(torch.int8)
    packed4 = torch._convert_weight_to_int4pack_for_cpu(q4.codes.to(torch.int32), 1)
    # torch's int4 format: w = (q - 8) * scale + zero, with [K/g, N, 2] scale/zero pairs.
    zeros4 = q4.mins.float() + 8 * q4.scales.float()
    sz4 = torch.stack([q4.scales.float().t(), zeros4.t()], dim=-1).contiguous()
    found: dict[str, Candidate] = {
        "fp32 F.linear": (F.linear, (int8.dequantize(),), torch.float32),
        "bf16 F.linear": (F.linear, (int8.dequantize(torch.bfloat16),), torch.bfloat16),
        "torch int8pack (bf16 x)": (torch._weight_int8pack_mm, (w_i8, q8.scales.bfloat16().squeeze(1)),
                                    torch.bfloat16),
        "vivace int8": (lambda x, layer: layer(x), (int8,), torch.float32),
        "vivace int4": (lambda x, layer: layer(x), (int4,), torch.float32),
    }
    if m == 1:
        found["torch int4pack (fp32 x)"] = (lambda x, p, sz: torch._weight_int4pack_mm_for_cpu(x, p, 32, sz),
                                            (packed4, sz4), torch.float32)
    return found


def gguf_candidates(k: int, n: int, m: int) -> dict[str, Candidate]:
    """name -> candidate for the GGUF forms of a random ``[n, k]`` weight (module docstring)."""
    w = (torch.randn(n, k) * 0.05).numpy()
    q5_0 = from_gguf_blocks(gguf.quants.quantize(w, T.Q5_0), T.Q5_0)
    forms = {"Q5_0 as int5": q5_0, "Q5_0 widened to 8 bits": q5_0.widened(),
             "Q8_0 (Q6_K's old form)": from_gguf_blocks(gguf.quants.quantize(w, T.Q8_0), T.Q8_0),
             "Q6_K as int6": from_gguf_blocks(random_gguf_blocks(T.Q6_K, n, k, "cpu").numpy(), T.Q6_K),
             "Q4_K's old form (int4)": qf.quantize_int4(torch.from_numpy(w)),
             "Q4_K two-level": from_gguf_blocks(random_gguf_blocks(T.Q4_K, n, k, "cpu").numpy(), T.Q4_K),
             "Q5_K two-level": from_gguf_blocks(random_gguf_blocks(T.Q5_K, n, k, "cpu").numpy(), T.Q5_K)}
    iq4 = from_gguf_blocks(random_gguf_blocks(T.IQ4_NL, n, k, "cpu").numpy(), T.IQ4_NL)
    forms.update({"IQ4 as int4 + table": iq4, "IQ4 widened to 8 bits": iq4.widened()})
    if k % 256:  # K-quants need whole 256-column super-blocks (Gemma's K = 640 projections have none)
        forms = {name: form for name, form in forms.items() if form.sub_group == 0}
    found: dict[str, Candidate] = {"fp32 F.linear": (F.linear, (torch.from_numpy(w),), torch.float32)}
    for name, form in forms.items():
        found[f"vivace {name}"] = (lambda x, layer: layer(x), (QuantizedLinear(form),), torch.float32)
    return found


def weight_bytes(weights: tuple[object, ...]) -> int:
    return sum(w.weight_bytes() if isinstance(w, QuantizedLinear) else w.numel() * w.element_size()
               for w in weights)


def measure(k: int, n: int, m: int, rounds: int, clock: Callable[[], float],
            make: Callable[[int, int, int], dict[str, Candidate]] = candidates) -> dict[str, tuple[float, int]]:
    """name -> (median µs per call, weight bytes per call), candidates interleaved per round."""
    xs = {dt: torch.randn(m, k).to(dt) for dt in (torch.float32, torch.bfloat16)}
    plans = {}
    for name, (fn, weights, dtype) in make(k, n, m).items():
        nbytes = weight_bytes(weights)
        copies = [weights] + [copy.deepcopy(weights) for _ in range(-(-STREAM_BYTES // nbytes) - 1)]
        plans[name] = (fn, copies, xs[dtype], nbytes)
    names = list(plans)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 2):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn, copies, x, _ = plans[name]
            start = clock()
            for weights in copies:
                fn(x, *weights)
            if r >= 2:  # the first two rounds warm up
                samples[name].append((clock() - start) / len(copies) * 1e6)
    return {name: (statistics.median(samples[name]), plans[name][3]) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--gguf", action="store_true", help="Gemma 3 270M's GGUF forms and shapes")
    parser.add_argument("--shapes", nargs="+", help="labels of the shapes to run (default: all)")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads={args.threads} rounds={args.rounds} clock={args.clock}; weights streamed from memory")
    shapes, make = (GEMMA_SHAPES, gguf_candidates) if args.gguf else (SHAPES, candidates)
    for k, n, label in (shape for shape in shapes if args.shapes is None or shape[2] in args.shapes):
        for m in args.m:
            results = measure(k, n, m, args.rounds, clock, make)
            base = results["fp32 F.linear"][0]
            print(f"\n{label}: K={k} N={n} M={m}", flush=True)
            for name, (us, nbytes) in results.items():
                print(f"  {name:24s} {us:9.1f} µs  {nbytes / us / 1e3:6.1f} GB/s  {base / us:5.2f}x vs fp32")


if __name__ == "__main__":
    main()
