"""The served path on a simulated GPU: the real ``vivace serve`` (HTTP, the engine thread, the
scheduler and its pacer, the overlap scheduler, detokenization, SSE) over a runner that, instead
of running a model, keeps a virtual device busy for the step costs measured on a GPU
(``benchmarks/pacer_sim.py``'s 8B shape on an H200) and returns tokens. The host does all of its
own work per step (the batch's arrays, the device sampler's staging); the device's share is a
queue in wall time, so host work the overlap scheduler hides on a GPU is hidden here too.

    .venv/bin/python benchmarks/served_sim.py [--streams 1,16,64] [--eager]

It prints ``vivace bench``'s figures of each stream count (512-token prompts, 128 new tokens,
closed loop) beside ``pacer_sim``'s virtual-time figures for the same load: the scheduler's plans
alone. Where the two part, the loss is in the served path around the plans, and this reproduces
it on a CPU. The server's own step records (``/debug/timings``) of each run are summarised too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pacer_sim  # noqa: E402  (benchmarks/ is not a package)
import timings_report  # noqa: E402

from vivace.config import EngineConfig  # noqa: E402
from vivace.engine.kv_cache import KVCacheManager  # noqa: E402
from vivace.engine.pacer import PromptPath  # noqa: E402
from vivace.engine.request import Request  # noqa: E402
from vivace.engine.sampler import SampledTokens  # noqa: E402
from vivace.engine.scheduler import ScheduledBatch  # noqa: E402
from vivace.gpu.runner import CudaRunner, Launched  # noqa: E402
from vivace.gpu.sampler import DeviceSampler, DeviceSamples  # noqa: E402
from vivace.models import LoadedModel  # noqa: E402


class VirtualDevice:
    """One stream of device work in wall time: a step launched runs once the steps before it
    finished, for its cost."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def queue(self, seconds: float) -> float:
        """Queue ``seconds`` of work; when it will be done (``time.perf_counter``)."""
        self.free_at = max(time.perf_counter(), self.free_at) + seconds
        return self.free_at


class Done:
    """What ``torch.cuda.Event`` is to a launched step: ``synchronize`` waits for its work."""

    def __init__(self, at: float) -> None:
        self.at = at

    def synchronize(self) -> None:
        delay = self.at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class SimulatedRunner(CudaRunner):
    """``CudaRunner``'s seam with the device simulated: its host work (``host_arrays``, the
    sampler's staging) runs as on a GPU; the forward is a cost on a :class:`VirtualDevice`;
    tokens are drawn at random from the vocabulary (``numpy``, seeded)."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, max_batch: int, max_num_seqs: int,
                 max_model_len: int, eager: bool, seed: int = 0) -> None:
        # Not CudaRunner.__init__: no model, no KV pool, no graphs; only what its host-side methods read.
        self.config = loaded.config
        self.device = torch.device("cpu")
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.max_model_len = max_model_len
        self.graphs = SimpleNamespace(max_batch=max_batch)  # what ``path`` and ``compiled_rows`` read
        self.prefill_graphs = None if eager else SimpleNamespace(buckets=list(pacer_sim.PROMPT_BUCKETS))
        self.gemv_choices = {}
        self.sampler = DeviceSampler(max(max_num_seqs, max_batch), loaded.config.vocab_size, max_model_len,
                                     loaded.config.eos_token_ids, seed, self.device)
        self.eager = eager
        self.virtual = VirtualDevice()
        self.rng = np.random.default_rng(seed)
        self.vocab = loaded.config.vocab_size

    def clear_blocks(self, block_ids: list[int]) -> None:
        pass

    def device_fault(self, exc: Exception) -> bool:
        return False

    def _cost_ms(self, batch: ScheduledBatch) -> float:
        if self.path(batch) is PromptPath.ROWS:
            return pacer_sim.decode_ms(len(batch.requests)) + pacer_sim.SAMPLER_MS
        return pacer_sim.prompt_step_ms(batch.total_tokens, batch.num_decode_tokens, self.eager)

    def _queued(self, ms: float, requests: list[Request]) -> Launched:
        done = self.virtual.queue(ms / 1e3)
        tokens = torch.from_numpy(self.rng.integers(0, self.vocab, len(requests), dtype=np.int32))
        packed = torch.stack([tokens, torch.ones_like(tokens)], 1)
        return Launched(list(requests), packed[:, 0], packed, Done(done))

    def launch(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int],
               requests: list[Request]) -> Launched:
        self.host_arrays(batch, kv)
        rows: list[Request | None] = list(requests)  # the prompt step samples its logits rows alone
        if self.path(batch) is PromptPath.ROWS:  # a decode graph samples each of its rows
            rows = [None] * len(batch.requests)
            for index, request in zip(logit_indices, requests):
                rows[index] = request
        self.sampler.stage(rows)
        return self._queued(self._cost_ms(batch), requests)

    def launch_next(self, previous: Launched, requests: list[Request], kv: KVCacheManager) -> Launched:
        for request in requests:  # the block tables the real one stages
            kv.block_ids(request.request_id)
        self.sampler.stage(list(requests), ahead=1)
        return self._queued(pacer_sim.decode_ms(len(requests)) + pacer_sim.SAMPLER_MS, requests)

    def collect(self, launched: Launched) -> DeviceSamples:
        launched.copied.synchronize()
        n = len(launched.requests)
        tokens = SampledTokens(launched.host[:, 0].tolist(), None, [[] for _ in range(n)], [[] for _ in range(n)])
        return DeviceSamples(tokens, [True] * n)

    def execute(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int]) -> torch.Tensor | None:
        self.host_arrays(batch, kv)
        Done(self.virtual.queue(self._cost_ms(batch) / 1e3)).synchronize()
        return torch.randn(len(logit_indices), self.vocab) if logit_indices else None


def serve(argv: list[str], eager: bool, switch_interval: float | None) -> None:
    """``vivace serve argv`` (a CPU device, dummy weights) with :class:`SimulatedRunner` as its runner."""
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval / 1e3)
    from vivace import cli
    from vivace.engine import backend

    def make_runner(config: EngineConfig, loaded: LoadedModel, num_blocks: int, max_model_len: int,
                    loaded_from_config: bool = False) -> SimulatedRunner:
        return SimulatedRunner(loaded, num_blocks, config.block_size, min(config.cuda_graph_max_batch,
                                                                          config.max_num_seqs),
                               config.max_num_seqs, max_model_len, eager, config.seed)

    backend.make_runner = make_runner
    if os.environ.get("SERVED_SIM_PACER_LOG"):  # every plan of the pacer, with its inputs and model
        logging.getLogger("vivace.engine.pacer").setLevel(logging.DEBUG)
    sys.exit(cli.main(["serve", *argv]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--eager", action="store_true", help="prompt steps eager (no prompt-step graphs)")
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--out", type=Path, default=None, help="keep bench and timings JSON here")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the server process's sys.setswitchinterval (default: as the server sets it)")
    parser.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args()
    if args.serve is not None:
        serve(args.serve, args.eager, args.switch_interval_ms)
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="served-sim-"))
    out.mkdir(parents=True, exist_ok=True)
    max_len = args.input_len + args.output_len + 64
    streams = [int(n) for n in args.streams.split(",")]
    command = [sys.executable, __file__, *(["--eager"] if args.eager else []),
               *([f"--switch-interval-ms={args.switch_interval_ms}"] if args.switch_interval_ms is not None else []),
               "--serve", "smollm2-135m",
               "--device", "cpu", "--load-format", "dummy", "--quantization", "none", "--dtype", "bfloat16",
               "--max-model-len", str(max_len), "--num-kv-blocks", str(max(streams) * 2 * -(-max_len // 16) + 64),
               "--port", str(args.port), "--log-level", "warning", *extra]
    server = subprocess.Popen(command, stdout=open(out / "server.txt", "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{args.port}"
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not start:\n{(out / 'server.txt').read_text()[-3000:]}")
            time.sleep(0.5)
        config = EngineConfig(model="-")
        print("| streams | served tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | plans alone (pacer_sim): tok/s, "
              "TTFT p50, ITL p50 |")
        print("|---|---|---|---|---|---|---|")
        since = 0.0
        notes = []
        for count in streams:
            n = 8 if count == 1 else 2 * count
            report = out / f"bench-{count}.json"
            subprocess.run([sys.executable, "-m", "vivace.cli", "bench", "--base-url", base, "--input-len",
                            str(args.input_len), "--output-len", str(args.output_len), "--num-requests", str(n),
                            "--warmup", str(2 if count == 1 else count), "--concurrency", str(count),
                            "--output-control", "ignore_eos", "--no-progress", "--output-json", str(report)],
                           check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            body = httpx.get(f"{base}/debug/timings", params={"since": since}, timeout=30).json()
            since = body.get("now", since)
            (out / f"timings-{count}.json").write_text(json.dumps(body))
            s = json.loads(report.read_text())["summary"]
            sim = pacer_sim.simulate(count, n * 2, args.input_len, args.output_len, 0.3, args.eager, config)
            print(f"| {count} | {s['output_throughput']:,.0f} | {s['ttft']['median']:.0f} ms | "
                  f"{s['ttft']['p99']:.0f} ms | {s['itl']['median']:.2f} ms | {s['itl']['p99']:.2f} ms | "
                  f"{sim['tokens_per_s']:,.0f}, {sim['ttft_p50_ms']:.0f} ms, {sim['itl_p50_ms']:.2f} ms |", flush=True)
            notes += [f"\n{count} streams, the server's steps:\n", *timings_report.step_report(body.get("steps", []))]
        print("\n".join(notes))
        print(f"\nJSON: {out}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
