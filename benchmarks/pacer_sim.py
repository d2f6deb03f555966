"""The scheduler and its pacer in virtual time, on step costs measured on a GPU: what the policy
alone gives a closed loop of streams, apart from the server and the host work around each step.

Each step's batch comes from the real ``Scheduler`` (its KV manager and the pacer the CUDA
runner's engine builds: no rows path, eager steps filled); its duration is a cost model of the
8B shape on an H200 (docs/benchmarks.md, "The CUDA backend on a GPU: third run"), plus
``--host-ms`` of host work a step; the pacer learns from those durations as the engine's does.
``--streams`` clients each send a ``--prompt``-token request for ``--output`` tokens at once,
and another as each finishes, until ``--requests`` were sent.

    .venv/bin/python benchmarks/pacer_sim.py [--streams 1,16,64] [--host-ms 0.3] [--eager]

The served run of that section (64 streams: 1,170 tokens/s, TTFT p50 5.8 s) against this
simulation with its measured step costs (then ~3,300 tokens/s, TTFT p50 0.9 s) said the loss was
outside the scheduler's plans; ``benchmarks/served_sim.py`` (the real server over a device simulated
on these costs) found it inside them after all: the pacer's plans under the server's measured,
noisier step times (docs/benchmarks.md, "64 streams behind the server, on a simulated GPU").
"""

from __future__ import annotations

import argparse
import itertools
import statistics

from vivace.config import EngineConfig
from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.pacer import pacer_for
from vivace.engine.request import Request
from vivace.engine.sampling_params import SamplingParams
from vivace.engine.scheduler import Scheduler

# Measured, Llama-3.1-8B shape, bf16, H200 (docs/benchmarks.md, "third run"): the engine's decode
# step with the device sampler by batch (ms); the prompt-step graph of T tokens, ~4.28 + 0.0174 T
# ms (128: 6.50, 512: 13.17), never below the decode step; an eager prompt step ~13.4 ms at least
# (its host launches); and what each decode row riding in a prompt step adds to it (the served
# 64-stream run's step records: ~14.6 ms with ~10 rows, ~22 ms with ~57, at 512 tokens),
# ``--prompt-row-ms`` to price another attention for those rows.
DECODE_MS = ((1, 5.20), (8, 5.69), (32, 6.44), (64, 7.47))
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512)
PROMPT_MS, PROMPT_MS_PER_TOKEN, EAGER_MS, SAMPLER_MS = 4.28, 0.0174, 13.4, 0.4
PROMPT_ROW_MS = 0.16


def decode_ms(rows: int) -> float:
    """The decode step of ``rows`` rows, interpolated between the measured batches."""
    for (a, ya), (b, yb) in zip(DECODE_MS, DECODE_MS[1:]):
        if rows <= b:
            return ya + (yb - ya) * max(rows - a, 0) / (b - a)
    return DECODE_MS[-1][1]


def prompt_step_ms(tokens: int, decode_rows: int, eager: bool, row_ms: float = PROMPT_ROW_MS) -> float:
    """A step carrying prompt tokens, ``tokens`` in all (``decode_rows`` of them decodes, each
    adding ``row_ms``): the graph of the smallest bucket holding them, or the eager step (past the
    buckets, or with ``eager``)."""
    bucket = None if eager else next((b for b in PROMPT_BUCKETS if b >= tokens), None)
    rows = row_ms * decode_rows
    if bucket is None:
        return max(EAGER_MS, PROMPT_MS + PROMPT_MS_PER_TOKEN * tokens + rows) + SAMPLER_MS
    return max(decode_ms(decode_rows), PROMPT_MS + PROMPT_MS_PER_TOKEN * bucket + rows) + SAMPLER_MS


def simulate(streams: int, requests: int, prompt: int, output: int, host_ms: float, eager: bool,
             config: EngineConfig, row_ms: float = PROMPT_ROW_MS) -> dict[str, float]:
    kv = KVCacheManager(60_000, config.block_size, enable_prefix_caching=False)
    scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens, None,
                          pacer_for(config, 0, fill_eager=True, token_buckets=() if eager else PROMPT_BUCKETS))
    clock, numbers = 0.0, itertools.count()
    sent: dict[str, float] = {}
    times: dict[str, list[float]] = {}

    def send() -> None:
        i = next(numbers)
        if i < requests:
            request = Request(f"r{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=output, ignore_eos=True),
                              arrival_order=i, arrival_time=clock)
            sent[request.request_id], times[request.request_id] = clock, []
            scheduler.add(request)

    for _ in range(streams):
        send()
    steps = prompt_steps = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        if not batch:
            break
        if batch.num_prompt_tokens:
            ms = prompt_step_ms(batch.total_tokens, batch.num_decode_tokens, eager, row_ms)
            prompt_steps += 1
        else:
            ms = decode_ms(batch.num_decode_tokens) + SAMPLER_MS
        clock += (ms + host_ms) / 1e3
        steps += 1
        scheduler.observe_step(batch, (ms + host_ms) / 1e3, batch.prompt_path)
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.token_ids.append(0)
                times[request.request_id].append(clock)
                if request.num_output_tokens >= output:
                    scheduler.finish(request)
                    send()
    ttft = sorted((t[0] - sent[r]) * 1e3 for r, t in times.items() if t)
    gaps = sorted((b - a) * 1e3 for t in times.values() for a, b in zip(t, t[1:]))
    return {"tokens_per_s": sum(map(len, times.values())) / clock, "ttft_p50_ms": statistics.median(ttft),
            "ttft_p99_ms": ttft[max(int(0.99 * len(ttft)) - 1, 0)], "itl_p50_ms": statistics.median(gaps),
            "itl_p99_ms": gaps[max(int(0.99 * len(gaps)) - 1, 0)], "prompt_steps": prompt_steps, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--host-ms", type=float, default=0.3, help="host work a step, beside the device's")
    parser.add_argument("--eager", action="store_true", help="prompt steps eager (no prompt-step graphs)")
    parser.add_argument("--itl-target-ms", type=float, default=None, help="as vivace serve's")
    parser.add_argument("--prompt-row-ms", type=float, default=PROMPT_ROW_MS,
                        help="what a decode row adds to a prompt step (the decode step's is ~0.03)")
    args = parser.parse_args()
    config = EngineConfig(model="-", itl_target_ms=args.itl_target_ms)
    print("| streams | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | steps with prompt |")
    print("|---|---|---|---|---|---|---|")
    for streams in map(int, args.streams.split(",")):
        r = simulate(streams, streams * args.requests_per_stream, args.prompt, args.output, args.host_ms,
                     args.eager, config, args.prompt_row_ms)
        print(f"| {streams} | {r['tokens_per_s']:,.0f} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
              f"{r['itl_p50_ms']:.2f} ms | {r['itl_p99_ms']:.2f} ms | {r['prompt_steps']} of {r['steps']} |")


if __name__ == "__main__":
    main()
