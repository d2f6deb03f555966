"""One benchmark run from start to summary: find the model, probe which fields pin the
output length, build the workload, warm up, measure, summarize."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx

from vivace.bench.client import Api, Endpoint, OutputControl, RequestResult, stream_request
from vivace.bench.load import LoadPlan, run_load, warm_up
from vivace.bench.progress import ProgressBar
from vivace.bench.stats import Slo, Summary, summarize
from vivace.bench.workloads import (
    Conversation, PromptFactory, jsonl_prompts, load_tokenizer, multi_turn_chats, random_prompts,
    shared_prefix_prompts,
)

Workload = Literal["random", "shared-prefix", "multi-turn", "jsonl"]
_PROBE_ORDER: tuple[tuple[OutputControl, bool], ...] = (
    ("ignore_eos", True), ("min_tokens", True), ("none", True),
    ("ignore_eos", False), ("min_tokens", False), ("none", False),
)


class BenchError(Exception):
    """The benchmark cannot run at all (server unreachable, no model, every warm-up
    request failed, a workload that cannot be built)."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run needs; `output_control="auto"` probes the server."""

    base_url: str = "http://127.0.0.1:8000"
    api: Api = "completions"
    model: str | None = None
    api_key: str | None = None
    workload: Workload = "random"
    input_len: int = 128
    output_len: int = 128
    prefix_len: int = 0
    turns: int = 3
    dataset: str | None = None
    tokenizer: str | None = None
    num_requests: int = 50
    warmup: int = 2
    plan: LoadPlan = field(default_factory=LoadPlan)
    request_timeout_s: float = 120.0
    slo: Slo | None = None
    output_control: OutputControl | Literal["auto"] = "auto"
    temperature: float | None = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True


@dataclass
class BenchOutcome:
    """The endpoint as probed, the summary, every measured request, and run metadata."""

    endpoint: Endpoint
    summary: Summary
    results: list[RequestResult]
    meta: dict[str, Any]


async def run_benchmark(config: BenchConfig) -> BenchOutcome:
    """Run the whole benchmark against `config.base_url`. Raises BenchError when it
    cannot start or when every warm-up request fails."""
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        endpoint = await resolve_endpoint(client, config)
        warmups, measured = build_workload(config)
        if warmups:
            outcomes = await warm_up(client, endpoint, warmups, config.plan.concurrency)
            if not any(result.success for result in outcomes):
                raise BenchError(f"every warm-up request failed, first: {outcomes[0].error_kind}: {outcomes[0].error}")
        bar = ProgressBar(min(config.num_requests, sum(len(c.turns) for c in measured)), config.progress)
        run = await run_load(client, endpoint, measured, config.plan, on_result=bar.update)
        bar.close()
    summary = summarize(run.results, run.duration_s, config.slo)
    return BenchOutcome(endpoint, summary, run.results, run_meta(config, endpoint))


async def resolve_endpoint(client: httpx.AsyncClient, config: BenchConfig) -> Endpoint:
    """The endpoint with the model named (the server's first, if not given) and the
    output-length fields the server accepts."""
    model = config.model or await first_model(client, config.base_url, config.api_key)
    extra = dict(config.extra_body)
    if config.temperature is not None:
        extra.setdefault("temperature", config.temperature)
    endpoint = Endpoint(config.base_url, config.api, model, config.api_key, extra_body=extra)
    if config.output_control != "auto":
        return replace(endpoint, output_control=config.output_control)
    return await probe_output_control(client, endpoint)


async def first_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The id of the first model listed at /v1/models. Raises BenchError if none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"cannot list models at {base_url}/v1/models: {exc!r}; pass --model") from exc


async def probe_output_control(client: httpx.AsyncClient, endpoint: Endpoint) -> Endpoint:
    """Try `ignore_eos`, then `min_tokens`, then neither (with and without usage in the
    stream) and keep the first the server accepts. Raises BenchError if it accepts
    none, or fails for a reason other than a rejected field."""
    prompt: str | list[dict[str, str]] = "Hello" if endpoint.api == "completions" else [
        {"role": "user", "content": "Hello"}]
    last: RequestResult | None = None
    for control, usage in _PROBE_ORDER:
        candidate = replace(endpoint, output_control=control, include_usage=usage)
        last = await stream_request(client, candidate, prompt, 2, time.perf_counter())
        if last.success:
            return candidate
        if last.error_kind not in ("http_400", "http_422"):
            break
    raise BenchError(f"probe request to {endpoint.url} failed: {last.error_kind}: {last.error}")


def build_workload(config: BenchConfig) -> tuple[list[Conversation], list[Conversation]]:
    """(warm-up conversations, measured conversations), with different prompts, so a
    prefix cache warmed up learns nothing about the measured prompts beyond a shared
    prefix. Raises BenchError when the workload cannot be built."""
    try:
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        factory = PromptFactory(tokenizer, config.plan.seed)
        if config.workload == "jsonl":
            if not config.dataset:
                raise ValueError("the jsonl workload needs --dataset")
            conversations = jsonl_prompts(config.dataset, factory, config.output_len)
            return conversations[: config.warmup], conversations[config.warmup :]
        turns = config.turns if config.workload == "multi-turn" else 1
        count = config.warmup + math.ceil(config.num_requests / turns)
        conversations = make_conversations(config, factory, count)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot build the {config.workload} workload: {exc}") from exc
    return conversations[: config.warmup], conversations[config.warmup :]


def make_conversations(config: BenchConfig, factory: PromptFactory, count: int) -> list[Conversation]:
    """`count` generated conversations of the configured workload."""
    if config.workload == "random":
        return random_prompts(factory, count, config.input_len, config.output_len)
    if config.workload == "shared-prefix":
        return shared_prefix_prompts(factory, count, config.input_len, config.output_len, config.prefix_len)
    if config.workload == "multi-turn":
        return multi_turn_chats(factory, count, config.turns, config.input_len, config.output_len)
    raise ValueError(f"unknown workload {config.workload!r}")


def run_meta(config: BenchConfig, endpoint: Endpoint) -> dict[str, Any]:
    """What was run, for the JSON file."""
    plan = config.plan
    return {
        "base_url": endpoint.base_url, "api": endpoint.api, "model": endpoint.model,
        "output_control": endpoint.output_control, "include_usage": endpoint.include_usage,
        "workload": config.workload, "input_len": config.input_len, "output_len": config.output_len,
        "prefix_len": config.prefix_len, "turns": config.turns, "dataset": config.dataset,
        "tokenizer": config.tokenizer, "num_requests": config.num_requests, "warmup": config.warmup,
        "concurrency": plan.concurrency, "request_rate": None if math.isinf(plan.request_rate) else plan.request_rate,
        "burstiness": plan.burstiness, "max_duration_s": plan.max_duration_s, "seed": plan.seed,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
