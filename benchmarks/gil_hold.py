"""How long the engine thread keeps other Python threads (the server's event loop) from running.

    python benchmarks/gil_hold.py [--streams 8] [--prompt-len 200] [--max-tokens 150] [--threads 2]
                                  [--torch-loader]

A compiled engine (default model) decodes ``--streams`` sequences of distinct random prompts while
a second thread sleeps 1 ms in a loop and records how late each wake-up is: a wake-up waits for
the GIL when the step holds it. Prints the decode step's median and the wake-ups' lateness
(median, p90, p99, max). The server's event loop is such a thread: while it waits, the tokens of
the step before are not sent. ``--torch-loader`` runs the decode package through torch's own
loader (which holds the GIL for the run) instead of vivace's runner, for a baseline.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from vivace.config import EngineConfig
from vivace.engine import aot_decode
from vivace.engine.llm_engine import LLMEngine
from vivace.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torch-loader", action="store_true", help="torch's package loader, not vivace's runner")
    args = parser.parse_args()
    if args.torch_loader:
        aot_decode._native_runner = lambda: False
    engine = LLMEngine(EngineConfig(model="default", compile=True, num_threads=args.threads, kv_cache_memory_gb=1))
    for i in range(args.streams):
        prompt = torch.randint(100, 40000, (args.prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    while engine.has_unfinished() and any(r.num_computed_tokens < args.prompt_len for r in engine.requests.values()):
        engine.step()  # the prompts first: only decode steps are measured

    late: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            time.sleep(0.001)
            late.append(time.perf_counter() - start - 0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    stop.set()
    thread.join()
    late.sort()

    def pct(q: float) -> float:
        return late[min(len(late) - 1, int(q * len(late)))] * 1e3

    print(f"{len(steps)} decode steps, median {statistics.median(steps) * 1e3:.1f} ms; 1 ms sleeps woke late by "
          f"median {pct(0.5):.2f}, p90 {pct(0.9):.2f}, p99 {pct(0.99):.2f}, max {late[-1] * 1e3:.1f} ms "
          f"({len(late)} wake-ups)")


if __name__ == "__main__":
    main()
