"""What the host sampler costs a step with sampling filters on: temperature alone, top-p, top-k and
min-p, for 1 and 16 rows, at the default model's vocabulary (49,152), Qwen's (151,936) and
Gemma 3's (262,144). With ``--baseline DIR`` (another checkout), its sampler runs on the same
logits in the same process, turn about, so both see the same machine. Prints medians in µs.

    python benchmarks/sampler_filters.py --baseline ../vivace-before
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from vivace.engine.request import Request
from vivace.engine.sampler import Sampler
from vivace.engine.sampling_params import SamplingParams

FILTERS = {"temperature 0.7": dict(temperature=0.7), "top_p 0.9": dict(temperature=0.7, top_p=0.9),
           "top_k 40": dict(temperature=0.8, top_k=40), "top_k 64 + top_p 0.95": dict(temperature=1.0, top_k=64, top_p=0.95),
           "min_p 0.1": dict(temperature=1.0, min_p=0.1)}


def baseline_sampler(checkout: Path) -> type:
    """``Sampler`` of another checkout's ``vivace/engine/sampler.py``, importing the rest from this one."""
    spec = importlib.util.spec_from_file_location("baseline_sampler", checkout / "vivace" / "engine" / "sampler.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.Sampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another checkout whose sampler to time beside this one")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[49152, 151936, 262144])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--scale", type=float, default=5.0, help="logits are randn times this (5: a peaked row)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samplers = {"this": Sampler(eos_token_ids=(0,))}
    if args.baseline:
        samplers["baseline"] = baseline_sampler(args.baseline)(eos_token_ids=(0,))
    print("| vocabulary | rows | filters | " + " | ".join(f"{name} µs" for name in samplers) + " |")
    print("|---|---|---|" + "---|" * len(samplers))
    for vocab in args.vocabs:
        for rows in args.rows:
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * args.scale
            for label, params in FILTERS.items():
                requests = [Request(str(i), [1, 2], SamplingParams(**params)) for i in range(rows)]
                times: dict[str, list[float]] = {name: [] for name in samplers}
                for _ in range(args.repeats):
                    for name, sampler in samplers.items():
                        start = time.perf_counter()
                        sampler(logits, requests)
                        times[name].append(time.perf_counter() - start)
                medians = " | ".join(f"{statistics.median(t) * 1e6:,.0f}" for t in times.values())
                print(f"| {vocab:,} | {rows} | {label} | {medians} |", flush=True)


if __name__ == "__main__":
    main()
