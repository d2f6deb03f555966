"""Gemma 3 270M (Q4_K_M GGUF, the ``gemma-3-270m`` one-word model) in vivace, batch 1.

Per configuration (quantization x dtype): TTFT for 128- and 512-token prompts, median decode
ITL over 32 tokens, and the logits layer alone (262,144 x 640: about a third of the model's
weight bytes) at M = 1, with the bandwidth it achieves. The native int4/int5/int8 kernels need
AVX-512 VNNI: where the CPU lacks it the quantized rows show the PyTorch fallback (a
dequantization per call), and say so. ``--profile`` instead shows where an eager batch-1 decode
step spends its time, op by op and input shape by input shape (the logits layer is the
``quant_linear`` whose input is the 262,144-row weight). The served comparison with llama.cpp is
``benchmarks/peers.py --model gemma-3-270m``.

    .venv/bin/python benchmarks/gemma3.py [--threads 2] [--configs auto:float32 none:float32 none:bfloat16]
    .venv/bin/python benchmarks/gemma3.py --profile [--configs auto:float32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from decode_step import make_runner, profile
from vivace import LLM, SamplingParams
from vivace.kernels import quant_linear_kernel
from vivace.models import load_model


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


def _weight_bytes(layer: torch.nn.Module) -> int:
    """Bytes one pass over a (quantized or float) linear layer's weight reads."""
    return layer.weight_bytes() if hasattr(layer, "weight_bytes") else layer.weight.numel() * layer.weight.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["auto:float32", "none:float32", "none:bfloat16"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="profile an eager batch-1 decode step instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = quant_linear_kernel() is not None
    print(f"native quantized kernels: {'yes' if native else 'no (CPU without AVX-512 VNNI): PyTorch fallback'}")
    if args.profile:
        for config in args.configs:
            quantization, dtype = config.split(":")
            loaded = load_model("gemma-3-270m", getattr(torch, dtype), quantization)
            runner = make_runner(loaded, loaded.model.embed_tokens.weight.dtype, [1], 128, None)
            print(f"--- {config}: 5 eager batch-1 decode steps at context 128 ---")
            print(profile(runner, 128, by_shape=True, row_limit=25), flush=True)
        return
    print("| quantization | dtype | weights MB | TTFT 128 (ms) | TTFT 512 (ms) | ITL p50 (ms) | logits layer (ms) "
          "| logits layer (GB/s) |")
    print("|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        quantization, dtype = config.split(":")
        llm = LLM("gemma-3-270m", quantization=quantization, dtype=dtype, num_threads=args.threads,
                  num_kv_blocks=96, block_size=16, max_num_batched_tokens=1024)
        ttft(llm, prompt(16, seed=0))  # warm-up
        t128, t512 = ttft(llm, prompt(128, seed=1)), ttft(llm, prompt(512, seed=2))
        gap = itl(llm, prompt(64, seed=3), args.tokens)
        head = logits_layer(llm, llm.engine.config.torch_dtype)
        model = llm.engine.loaded.model
        head_bytes = _weight_bytes(model.embed_tokens if model.lm_head is None else model.lm_head)
        print(f"| {quantization} | {dtype} | {llm.engine.loaded.weight_bytes / 1e6:.0f} | {t128 * 1e3:.0f} | "
              f"{t512 * 1e3:.0f} | {gap * 1e3:.1f} | {head * 1e3:.1f} | {head_bytes / head / 1e9:.1f} |", flush=True)
        del llm


if __name__ == "__main__":
    main()
