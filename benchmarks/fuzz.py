"""Fuzz a live ``vivace serve`` with schemathesis, driven by the server's own /openapi.json,
while streams decode beside it: schemathesis must find nothing, and every stream must end with
all of its tokens.

    python benchmarks/fuzz.py --max-time 600            # the long run quoted in docs
    python benchmarks/fuzz.py --max-time 120 --seed 7   # replay a seed

Phases: coverage and fuzzing; checks: not_a_server_error, negative_data_rejection,
positive_data_acceptance, response_schema_conformance; no shrinking, continue on failure. The
seed is printed first, so a failure can be replayed. Exit status 0 only if both hold.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
CHECKS = "not_a_server_error,negative_data_rejection,positive_data_acceptance,response_schema_conformance"
STREAM_TOKENS = 48
SERVED_MODEL = "fuzzed"  # the name the Messages API's positive cases ask for (fuzz_hooks.MODEL)


def start_server(port: int, model: str, log: Path) -> subprocess.Popen:
    """``vivace serve`` on the default model (eager, a short context so cases stay small), served
    as SERVED_MODEL."""
    command = [sys.executable, "-m", "vivace.cli", "serve", model, "--port", str(port), "--eager",
               "--max-model-len", "1024", "--log-level", "warning", "--served-model-name", SERVED_MODEL]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited during start-up; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server never became healthy")


class Streams:
    """Keeps ``count`` streams decoding until stopped; records any that ended short."""

    def __init__(self, base_url: str, count: int) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.completed = 0
        self.broken: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(count)]

    def __enter__(self) -> Streams:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(300)

    def _loop(self, index: int) -> None:
        body = {"prompt": f"Stream {index}: a story about the sea.", "max_tokens": STREAM_TOKENS,
                "temperature": 0.8, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        while not self.stop.is_set():
            tokens, finish = 0, None
            with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        for choice in event.get("choices", []):
                            finish = choice.get("finish_reason") or finish
                        tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
            if (tokens, finish) == (STREAM_TOKENS, "length"):
                self.completed += 1
            else:
                self.broken.append(f"stream {index} ended with {tokens} tokens, finish {finish}")


def fuzz(base_url: str, seed: int, max_time: int, max_examples: int, request_timeout: int = 60,
         phases: str = "coverage,fuzzing") -> int:
    """Runs schemathesis against ``base_url``; returns its exit status. The coverage phase's
    cases hardly depend on the seed (the fuzzing phase's do)."""
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [str(Path(sys.executable).with_name("st")), "run", f"{base_url}/openapi.json",
               "--checks", CHECKS, "--phases", phases, "--no-shrink",
               "--continue-on-failure", "--seed", str(seed), "--max-time", str(max_time),
               "--max-examples", str(max_examples), "--request-timeout", str(request_timeout), "--no-color",
               "--warnings", "off", "--output-sanitize", "false"]
    return subprocess.run(command, env=env, timeout=max_time + 300).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="fuzz this running server instead of starting one")
    parser.add_argument("--model", default="default")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    parser.add_argument("--max-time", type=int, default=600, help="seconds of fuzzing")
    parser.add_argument("--max-examples", type=int, default=10_000, help="cases per operation")
    parser.add_argument("--streams", type=int, default=4, help="streams decoding beside the fuzzer")
    parser.add_argument("--request-timeout", type=int, default=60, help="seconds one case may take")
    parser.add_argument("--log", type=Path, default=Path("fuzz-server.log"))
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"fuzz seed {seed} (replay: python benchmarks/fuzz.py --seed {seed})", flush=True)
    server = None if args.url else start_server(args.port, args.model, args.log)
    base_url = args.url or f"http://127.0.0.1:{args.port}"
    try:
        with Streams(base_url, args.streams) as streams:
            status = fuzz(base_url, seed, args.max_time, args.max_examples, args.request_timeout)
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    print(f"streams beside the fuzzer: {streams.completed} whole, {len(streams.broken)} broken", flush=True)
    for line in streams.broken:
        print(line)
    return 0 if status == 0 and not streams.broken else 1


if __name__ == "__main__":
    sys.exit(main())
