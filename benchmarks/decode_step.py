"""Decode-step latency of a model (the default one unless ``--model``): eager (plain or prepacked
linears) against compiled.

    python benchmarks/decode_step.py [--model PATH] [--dtypes float32 bfloat16] [--batch-sizes 1 16]
        [--context 128] [--rounds 20] [--threads N] [--variants default cpp_wrapper ...]
        [--quantization none|int8|int4|auto] [--profile] [--start]

Every runner decodes the same batch (each sequence ``--context`` tokens long), interleaved
step by step, round after round, so all of them see the same machine load. Prints the median
ms per step, tokens/s, and bandwidth achieved (weight bytes / step time). ``--profile`` shows
where eager and compiled batch-1 steps spend their time (torch.profiler). ``--start`` times
building a compiled runner (compiling or loading its two graphs, one sequence and several) in
fresh processes: first with an empty inductor cache (cold), then with the cache that run left (warm).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from vivace.engine.runner import ModelRunner
from vivace.layers.packed_linear import prepack_linears
from vivace.models import LoadedModel, load_model

BLOCK_SIZE = 16
# Inductor settings in force while a runner compiles. (Freezing, which packs weights per graph,
# has nothing left to pack: the engine prepacks them once, for every graph and eager step.)
VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "cpp_wrapper": {"cpp_wrapper": True},
}


def make_runner(loaded: LoadedModel, dtype: torch.dtype, batch_sizes: list[int], context: int,
                options: dict[str, object] | None) -> ModelRunner:
    """A runner with room for ``max(batch_sizes)`` sequences of ``context + 1`` tokens; compiled
    (under inductor settings ``options``) for up to that many unless ``options`` is None."""
    num_blocks = max(batch_sizes) * -(-(context + 1) // BLOCK_SIZE)
    compile_max_batch = 0 if options is None else max(batch_sizes)
    with torch._inductor.config.patch(options or {}):
        return ModelRunner(loaded, num_blocks, BLOCK_SIZE, dtype, compile_max_batch=compile_max_batch)


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def decode_batch(batch: int, context: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Token ids, positions and block tables of ``batch`` sequences that each add token ``context + 1``."""
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    return [100 + i for i in range(batch)], [context] * batch, tables


def time_runners(runners: dict[str, ModelRunner], batch: int, context: int, rounds: int) -> dict[str, float]:
    """Median seconds per decode step of each runner, measured interleaved."""
    ids, positions, tables = decode_batch(batch, context)
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.inference_mode():
        for name, runner in runners.items():
            runner.decode(ids, positions, tables)
        for _ in range(rounds):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.decode(ids, positions, tables)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def profile(runner: ModelRunner, context: int, by_shape: bool = False, row_limit: int = 12) -> str:
    """torch.profiler's table of the ops five batch-1 decode steps run, by self CPU time (each
    op's input shapes apart when ``by_shape``)."""
    ids, positions, tables = decode_batch(1, context)
    with torch.inference_mode():
        runner.decode(ids, positions, tables)
        with torch.profiler.profile(record_shapes=by_shape) as prof:
            for _ in range(5):
                runner.decode(ids, positions, tables)
    return prof.key_averages(group_by_input_shape=by_shape).table(sort_by="self_cpu_time_total",
                                                                 row_limit=row_limit, max_name_column_width=40)


def run_latency(args: argparse.Namespace, variant: str) -> None:
    """Eager with plain ``F.linear`` layers, eager with prepacked ones (as the engine runs) and one
    compiled variant over the prepacked model, interleaved in this process. One variant per
    process: dynamo would hand a second variant the graphs the first compiled, whatever its settings."""
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        plain, loaded = (load_model(args.model, dtype, args.quantization) for _ in range(2))
        prepack_linears(loaded.model)
        runners = {"eager F.linear": make_runner(plain, dtype, args.batch_sizes, args.context, None),
                   "eager packed": make_runner(loaded, dtype, args.batch_sizes, args.context, None)}
        start = time.perf_counter()
        runners[f"compiled {variant}"] = make_runner(loaded, dtype, args.batch_sizes, args.context, VARIANTS[variant])
        print(f"{dtype_name} {variant}: compiled in {time.perf_counter() - start:.1f} s, "
              f"process RSS now {resident_mb():.0f} MB", flush=True)
        for batch in args.batch_sizes:
            medians = time_runners(runners, batch, args.context, args.rounds)
            base = medians["eager F.linear"]
            for name, seconds in medians.items():
                print(f"{dtype_name:9} batch {batch:3} {name:32} {seconds * 1e3:8.2f} ms/step "
                      f"{batch / seconds:8.1f} tok/s  bandwidth achieved {loaded.weight_bytes / seconds / 1e9:5.1f} GB/s"
                      f"  ({base / seconds:4.2f}x eager F.linear)", flush=True)
        if args.profile:
            for name, runner in runners.items():
                print(f"--- {dtype_name} {name}, 5 batch-1 steps ---\n{profile(runner, args.context)}", flush=True)


def time_start(args: argparse.Namespace) -> None:
    """Print the seconds building a compiled runner takes in this process (model already loaded)."""
    dtype = getattr(torch, args.dtypes[0])
    loaded = load_model(args.model, dtype, args.quantization)
    prepack_linears(loaded.model)
    start = time.perf_counter()
    make_runner(loaded, dtype, args.batch_sizes, args.context, VARIANTS[args.variants[0]])
    print(f"{time.perf_counter() - start:.1f}")


def run_start(args: argparse.Namespace) -> None:
    """Time building a compiled runner in fresh processes: empty inductor cache (cold), then warm."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for label in ("cold", "warm"):
            for dtype_name in args.dtypes:
                command = [sys.executable, __file__, "--time-start", "--model", args.model, "--dtypes", dtype_name,
                           "--batch-sizes",
                           *map(str, args.batch_sizes), "--variants", args.variants[0],
                           "--quantization", args.quantization]
                if args.threads:
                    command += ["--threads", str(args.threads)]
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                print(f"{label} start, {dtype_name}, {args.variants[0]}: "
                      f"{out.stdout.split()[-1]} s to compile and warm up", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--model", default="default", help="a .gguf file, a model directory or a bundled name")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "auto"],
                        help="auto: the GGUF's own formats where the native kernels run them (as served)")
    parser.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--start", action="store_true", help="time cold and warm start instead")
    parser.add_argument("--time-start", action="store_true", help=argparse.SUPPRESS)  # one --start sample
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.time_start:
        time_start(args)
    elif args.start:
        run_start(args)
    elif len(args.variants) == 1:
        run_latency(args, args.variants[0])
    else:
        for variant in args.variants:
            subprocess.run([sys.executable, *sys.argv, "--variants", variant], check=True)


if __name__ == "__main__":
    main()
