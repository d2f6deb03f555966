"""The ingress: vivace's own OpenAI app (the same routes, protocol, errors, auth, tiers,
admission control and SSE code as the single-process server) as a Ray Serve deployment, with
a ServerState whose engines are the versions' replicas, plus ``/replicas``, the
``x-vivace-replica`` / ``x-vivace-version`` headers and cluster-wide engine metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from fastapi import Depends, FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from vivace.cluster.client import (
    PLACEMENT, ROUTING_DECISIONS, Placement, RemoteEngine, ServedModel, Version)
from vivace.cluster.config import ClusterConfig
from vivace.cluster.proxy import DropServeRequestIds
from vivace.engine.llm_engine import EngineStats
from vivace.engine.step_timing import StepTimings
from vivace.server.app import build_app, require_api_key
from vivace.server.asgi import HTTPMiddleware
from vivace.server.errors import APIError
from vivace.server.metrics import EngineStatsCollector, engine_timing_families
from vivace.server.settings import ServerSettings
from vivace.server.state import LOADING_RETRY_AFTER_S, Caller, ServerState, path_aliases, server_state
from vivace.server.tiers import DEFAULT_TIER

logger = logging.getLogger("vivace.cluster")
REFRESH_S = 0.5  # how often the ingress asks every replica for its stats
_STATS_FIELDS = set(EngineStats.__dataclass_fields__)


class ClusterState(ServerState):
    """Serves ``models`` (name -> versions), each also under its ``aliases`` (alias -> name);
    ``deployments`` maps each deployment name to its (model, version). Replica stats are
    refreshed every REFRESH_S by :meth:`refresh_forever`."""

    def __init__(self, settings: ServerSettings, models: dict[str, ServedModel],
                 deployments: dict[str, tuple[str, str]], handles: dict[str, DeploymentHandle],
                 aliases: dict[str, str] | None = None) -> None:
        self.models = models
        self.aliases = aliases or {}
        self.default_model = next(iter(models))
        self.deployments = deployments
        self.handles = handles
        self.replicas: dict[str, list[dict[str, Any]]] = {name: [] for name in deployments}
        super().__init__(settings=settings)
        for served in models.values():  # a reasoning parser must fit every version's tokenizer
            for version in served.versions:
                self.reasoning_parser(version.engine)
                logger.info("model %r: tool calls: %s", served.name, self.tool_format(version.engine).label)

    def engine_metrics(self) -> Collector:
        return _ClusterCollector(self)

    def unavailable(self) -> APIError | None:
        for name in self.models:
            if not any(r["state"] == "RUNNING" for d, (model, _) in self.deployments.items()
                       if model == name for r in self.replicas[d]):
                return APIError(503, f"The model '{name}' has no ready replica", code="not_ready",
                                retry_after=LOADING_RETRY_AFTER_S)
        return None

    def model_name(self, requested: str | None = None) -> str:
        return requested if requested in self.models or requested in self.aliases else self.default_model

    def served_models(self) -> list[tuple[str, Any]]:
        return [(name, model.versions[0].engine) for name, model in self.models.items()]

    def engine_timings(self) -> StepTimings:
        """404: timing events are per engine; the replicas' step timings are in /metrics."""
        raise APIError(404, "/debug/timings is per engine: behind the Ray Serve ingress, each replica's "
                            "step timings are in /metrics (labelled by replica)", code="not_found")

    def engine_for(self, model: str | None, caller: Caller | None = None) -> RemoteEngine:
        served = self.models.get(self.aliases.get(model, model) if model else self.default_model)
        if served is None:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"{', '.join(repr(m) for m in self.models)}", param="model",
                           code="model_not_found")
        return served.pick(caller.tier.name if caller else DEFAULT_TIER)

    async def refresh(self) -> None:
        """Asks every replica of every version for its stats (those that answer in time)."""
        async def one(name: str) -> None:
            answers = await self.handles[name].broadcast("stats").results_async(
                timeout_s=max(REFRESH_S * 4, 2.0), return_exceptions=True)
            self.replicas[name] = sorted((a for a in answers if isinstance(a, dict)),
                                         key=lambda a: a["replica"])
        await asyncio.gather(*(one(name) for name in self.deployments), return_exceptions=True)

    async def refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a failed round leaves the last answers; the next one retries
                logger.exception("could not refresh the replicas' stats")
            await asyncio.sleep(REFRESH_S)


class _ClusterCollector(Collector):
    """The engine series and step-timing histograms per replica (labels model, version,
    replica), replicas per version, and the prefix router's decisions."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.engines = EngineStatsCollector(self._samples, ("model", "version", "replica"))

    def _samples(self) -> list[tuple[tuple[str, ...], EngineStats]]:
        return [((r["model"], r["version"], r["replica"]),
                 EngineStats(**{k: v for k, v in r.items() if k in _STATS_FIELDS}))
                for replicas in self.state.replicas.values() for r in replicas]

    def collect(self) -> Iterator[Metric]:
        yield from self.engines.collect()
        yield from engine_timing_families([((r["model"], r["version"], r["replica"]), r.get("timings", {}))
                                           for replicas in self.state.replicas.values() for r in replicas],
                                          ("model", "version", "replica"))
        count = GaugeMetricFamily("vivace:replicas", "Running engine replicas per version.",
                                  labels=["model", "version"])
        decisions = CounterMetricFamily(
            "vivace:routing_decisions", "Requests routed: prefix_hit (to the replica holding "
            "the longest cached prefix), no_prefix (none held a long enough one), fallback (it was too busy).",
            labels=["model", "version", "outcome"])
        for name, (model, version) in self.state.deployments.items():
            count.add_metric([model, version], len(self.state.replicas[name]))
            for outcome in ("prefix_hit", "no_prefix", "fallback"):
                decisions.add_metric([model, version, outcome], ROUTING_DECISIONS[name, outcome])
        yield count
        yield decisions


async def list_replicas(request: Request) -> Response:
    """Every engine replica: id, model, version, pid, state, running, waiting, KV usage."""
    state = server_state(request)
    assert isinstance(state, ClusterState)
    await state.refresh()
    rows = [{"id": r["replica"], "model": r["model"], "version": r["version"], "pid": r["pid"],
             "state": r["state"], "running": r["num_running"], "waiting": r["num_waiting"],
             "kv_usage": r["kv_usage"]}
            for replicas in state.replicas.values() for r in replicas]
    return JSONResponse({"object": "list", "data": rows})


class PlacementHeaders(HTTPMiddleware):
    """ASGI middleware: holds a response's start until its first engine request has started
    on a replica (or the response is whole), then adds ``x-vivace-replica`` and
    ``x-vivace-version`` (comma-separated when a request's prompts ran on several)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        placement = Placement()
        PLACEMENT.set(placement)
        held: list[Message] = []
        started = False

        async def send_placed(message: Message) -> None:
            nonlocal started
            if started:
                await send(message)
                return
            held.append(message)
            whole = message["type"] == "http.response.body" and not message.get("more_body")
            if placement.replicas or whole:
                started = True
                held[0]["headers"] = [*held[0].get("headers", []), *_headers(placement)]
                for item in held:
                    await send(item)

        await self.app(scope, receive, send_placed)


def _headers(placement: Placement) -> list[tuple[bytes, bytes]]:
    if not placement.replicas:
        return []
    return [(b"x-vivace-replica", ",".join(placement.replicas).encode()),
            (b"x-vivace-version", ",".join(placement.versions).encode())]


@serve.ingress()
class Ingress:
    """The ingress deployment: ``engines`` maps each engine deployment's name to its handle."""

    def __init__(self, config: ClusterConfig, settings: ServerSettings,
                 engines: dict[str, DeploymentHandle]) -> None:
        self.config = config
        self.settings = settings
        self.engines = engines
        self.refresher: asyncio.Task | None = None

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """Asks each version for its engine's name, limits and tokenizer, then builds the app."""
        names = self.config.deployment_names
        infos = dict(zip(names.values(), await asyncio.gather(
            *(self.engines[name].describe.remote() for name in names.values()))))
        models, deployments, aliases = {}, {}, {}
        for i, model in enumerate(self.config.models):
            versions = [Version(RemoteEngine(self.engines[names[i, v.name]], v.name,
                                             infos[names[i, v.name]]), v.weight, v.tiers)
                        for v in model.versions]
            name = model.name or self.settings.served_model_name or versions[0].engine.model_name
            models[name] = ServedModel(name, versions)
            if model.name is None and self.settings.served_model_name is None:  # as vLLM: the path given
                aliases.update({alias: name for v in model.versions for alias in path_aliases(v.engine.model)})
            deployments.update({names[i, v.name]: (name, v.name) for v in model.versions})
        state = ClusterState(self.settings, models, deployments, self.engines, aliases)
        await state.refresh()
        self.refresher = asyncio.get_running_loop().create_task(state.refresh_forever())
        app = build_app(None, self.settings, state)
        app.add_api_route("/replicas", list_replicas, methods=["GET"], dependencies=[Depends(require_api_key)])
        app.add_middleware(PlacementHeaders)
        app.add_middleware(DropServeRequestIds)
        return app
